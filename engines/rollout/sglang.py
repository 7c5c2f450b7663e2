"""The GPU rollout engine: an adapter over sglang's in-process `Engine`.

The translations are pure functions, so they are tested where sglang cannot be installed; every
call follows sglang at release SGLANG_VERSION (tests/test_sglang_source.py checks them against its
files). Seeds: sglang reads `sampling_seed` only with `enable_deterministic_inference`, so the engine
starts in that mode. Caveat: sglang's log-probs are taken before top-k / top-p truncation, unlike the
Completion contract, which renormalises over the kept set.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from engines.rollout import probe_sglang
from engines.rollout.base import (
    Completion,
    FinishReason,
    RolloutEngine,
    RolloutEngineError,
    SamplingParams,
    finish_reason,
)
from engines.rollout.constrained import ConstraintError
from engines.transfer.base import iter_buckets as bucket_named_tensors

# HF buffers that are not weights: sglang's load_weights computes these itself.
SKIPPED_WEIGHT_SUFFIXES = ("rotary_emb.inv_freq",)


def to_sglang_sampling_params(params: SamplingParams, eos_token_ids: Iterable[int] = ()) -> dict[str, Any]:
    """One request's sampling params in sglang's names."""
    out: dict[str, Any] = {
        "max_new_tokens": params.max_new_tokens,
        "temperature": params.temperature,  # sglang turns 0 into greedy (top_k = 1) itself
        "top_p": params.top_p,
        "top_k": params.top_k if params.top_k > 0 else -1,  # sglang's "whole vocabulary"
        # The EOS ids are listed too: with skip_tokenizer_init sglang knows no tokenizer EOS.
        "stop_token_ids": sorted(set(params.stop_token_ids) | set(eos_token_ids)),
        "no_stop_trim": True,  # keep the stop token in the output, as the Completion contract says
    }
    if params.temperature == 0:
        out["top_k"] = 1
    return out


def sampling_params_per_row(
    params: SamplingParams, num_rows: int, eos_token_ids: Iterable[int] = ()
) -> dict[str, Any] | list[dict[str, Any]]:
    """One dict for the batch, or one per row when seeded (else copies of a prompt draw the same sample)."""
    base = to_sglang_sampling_params(params, eos_token_ids)
    if params.seed is None:
        return base
    return [{**base, "sampling_seed": params.seed + row} for row in range(num_rows)]


def finish_reason_from_sglang(finish: dict[str, Any] | None) -> FinishReason:
    """sglang's meta_info["finish_reason"] dict to ours; an abort or a missing reason raises."""
    kind = finish.get("type") if isinstance(finish, dict) else None
    detail = f": {finish.get('message', 'no message')}" if kind == "abort" else ""
    return finish_reason("sglang", finish, kind, detail)


def completion_from_sglang(output: dict[str, Any]) -> Completion:
    """One sglang output dict (generated with return_logprob=True) as a Completion; ids and log-probs
    from meta_info["output_token_logprobs"]: (logprob, token_id, text) entries."""
    meta = output["meta_info"]
    entries = meta.get("output_token_logprobs")
    if entries is None:
        raise RolloutEngineError(
            "sglang output has no output_token_logprobs: call generate with return_logprob=True"
        )
    token_ids = [int(entry[1]) for entry in entries]
    output_ids = output.get("output_ids")
    if output_ids is not None and list(output_ids) != token_ids:
        raise RolloutEngineError(
            f"sglang output_ids ({len(output_ids)} tokens) disagree with output_token_logprobs "
            f"({len(token_ids)} tokens)"
        )
    return Completion(
        token_ids=token_ids,
        log_probs=[float(entry[0]) for entry in entries],
        finish_reason=finish_reason_from_sglang(meta.get("finish_reason")),
    )


def is_sglang_weight(name: str) -> bool:
    """sglang takes HF names as they are; only non-weight buffers are left out."""
    return not name.endswith(SKIPPED_WEIGHT_SUFFIXES)


def check_sglang_result(result: Any, action: str) -> None:
    """sglang's update / memory calls answer (success, message) or an object with .success."""
    if isinstance(result, tuple) and len(result) >= 1 and isinstance(result[0], bool):
        success, message = result[0], result[1] if len(result) > 1 else ""
    elif hasattr(result, "success"):
        success = bool(result.success)
        message = getattr(result, "message", None) or getattr(result, "error_message", "")
    else:
        return  # calls that answer None or a plain value succeeded if they did not raise
    if not success:
        raise RolloutEngineError(f"sglang {action} failed: {message}")


class SGLangRolloutEngine(RolloutEngine):
    """An in-process sglang Engine on one GPU (or a tensor-parallel group starting at base_gpu_id)."""

    backend = "sglang"

    def __init__(
        self,
        model_path: str | Path,
        device: str = "cuda",
        dtype: str = "auto",
        *,
        tp_size: int = 1,
        base_gpu_id: int = 0,
        mem_fraction_static: float = 0.5,
        bucket_mb: int = 512,
        seed: int = 0,
        deterministic: bool = True,
        eos_token_ids: list[int] | None = None,
        max_lora_rank: int | None = None,
        **server_args: Any,
    ) -> None:
        if not device.startswith("cuda"):
            raise ValueError(
                f"rollout backend 'sglang' runs on CUDA only, not on device '{device}': use backend 'hf'"
            )
        problem = probe_sglang()
        if problem is not None:
            raise ImportError(problem)
        from sglang.srt.entrypoints.engine import Engine  # lazy: pulls in CUDA kernels

        super().__init__(model_path, eos_token_ids)
        self.dtype = None  # sglang casts incoming weights to its own dtype
        self.bucket_bytes = bucket_mb * 1024 * 1024
        self.device = torch.device("cuda", base_gpu_id)
        self._lora_name: str | None = None  # the adapter served, by its sglang name
        if max_lora_rank is not None:
            server_args = {
                **server_args,
                "enable_lora": True,
                "max_lora_rank": max_lora_rank,
                "lora_target_modules": ["all"],  # the adapter's own config says which
            }
        self._engine = Engine(
            model_path=str(model_path),
            dtype=dtype,
            tp_size=tp_size,
            base_gpu_id=base_gpu_id,
            mem_fraction_static=mem_fraction_static,
            enable_memory_saver=True,  # needed by release/resume_memory_occupation
            skip_tokenizer_init=True,  # token ids in, token ids out
            random_seed=seed,
            enable_deterministic_inference=deterministic,  # else sampling_seed is ignored
            **server_args,
        )

    def _generate(self, rows: list[list[int]], params: SamplingParams) -> list[Completion]:
        if params.constraint is not None:
            raise ConstraintError("response_format", "the sglang rollout engine does not enforce constraints here: "
                                  "serve the job with the hf or vllm rollout backend")  # fmt: skip
        outputs = self._engine.generate(
            input_ids=rows,
            sampling_params=sampling_params_per_row(params, len(rows), self.eos_token_ids),
            return_logprob=True,
            lora_path=None if self._lora_name is None else [self._lora_name] * len(rows),
        )
        return [completion_from_sglang(output) for output in outputs]

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        # Tensors go over as CUDA IPC handles, so they must live on the engine's GPU.
        stream = ((n, t.detach().to(self.device)) for n, t in named_tensors if is_sglang_weight(n))
        for bucket in bucket_named_tensors(stream, self.bucket_bytes):
            result = self._engine.update_weights_from_tensor(
                named_tensors=bucket, load_format=None, flush_cache=False
            )
            check_sglang_result(result, f"update_weights_from_tensor ({len(bucket)} tensors)")

    def load_adapter(self, config: dict, named_tensors: list[tuple[str, torch.Tensor]]) -> None:
        """From tensors; each version gets its own name, so no request runs on a half-replaced adapter."""
        if self._lora_name is not None:
            check_sglang_result(self._engine.unload_lora_adapter(self._lora_name), "unload_lora_adapter")
        name = f"tandem-v{self.weight_version + 1}"
        tensors = {n: t.detach().to(self.device) for n, t in named_tensors}
        result = self._engine.load_lora_adapter_from_tensors(name, tensors, config)
        check_sglang_result(result, f"load_lora_adapter_from_tensors ({len(tensors)} tensors)")
        self._lora_name = name

    def finish_update(self) -> int:
        # Cached prefixes hold keys/values of the old weights.
        check_sglang_result(self._engine.flush_cache(), "flush_cache")
        return super().finish_update()

    def release_memory(self) -> None:
        if not self.is_released:
            check_sglang_result(self._engine.release_memory_occupation(), "release_memory_occupation")
        super().release_memory()

    def resume_memory(self) -> None:
        if self.is_released:
            check_sglang_result(self._engine.resume_memory_occupation(), "resume_memory_occupation")
        super().resume_memory()

    def shutdown(self) -> None:
        self._engine.shutdown()
