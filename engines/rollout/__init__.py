"""Rollout engines, chosen by name in one place.

`hf` (transformers in this process, CPU or GPU) is always available; `sglang` needs the sglang
package and a GPU, and is probed before use so that a job asking for it fails early, with a
message that says what to install, rather than deep inside a worker.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from engines.rollout.base import Completion, RolloutEngine, RolloutEngineError, SamplingParams

BACKENDS = ("hf", "sglang")

__all__ = [
    "BACKENDS",
    "Completion",
    "RolloutEngine",
    "RolloutEngineError",
    "SamplingParams",
    "available_backends",
    "build_rollout_engine",
]


def available_backends() -> dict[str, str | None]:
    """Each backend name mapped to None when usable here, or to the reason it is not."""
    from engines.rollout.sglang import probe_sglang

    return {"hf": None, "sglang": probe_sglang()}


def build_rollout_engine(
    backend: str, model_path: str | Path, device: str = "cpu", dtype: str = "auto", **kw: Any
) -> RolloutEngine:
    """The named engine, loaded from an HF model folder. Extra keywords go to its constructor."""
    if backend == "hf":
        from engines.rollout.hf import HFRolloutEngine

        return HFRolloutEngine(model_path, device=device, dtype=dtype, **kw)
    if backend == "sglang":
        from engines.rollout.sglang import SGLangRolloutEngine, probe_sglang

        problem = probe_sglang()
        if problem is not None:
            raise ImportError(problem)
        return SGLangRolloutEngine(str(model_path), device=device, dtype=dtype, **kw)
    raise ValueError(f"unknown rollout backend '{backend}': choose one of {list(BACKENDS)}")
