"""The vLLM rollout engine: an adapter over vLLM's offline `LLM`, running inside this process.

VLLM_ENABLE_V1_MULTIPROCESSING=0 keeps vLLM's engine core and worker in this process, so the
trainer's tensors reach the rollout model without leaving it; token ids in, token ids out.
Log-probs are vLLM's "processed_logprobs" (after temperature and top-k / top-p: the Completion
contract), except that greedy sampling reports the unfiltered distribution. Each sample is its own
request seeded seed + row, so copies of a prompt draw different samples. Weights arrive through
vLLM's weight-update session with an in-process transfer backend (vllm_transfer.py); LoRA adapters
through a folder in RAM, since vLLM 0.32 loads adapters only from folders. On CPU vLLM has no sleep
mode: release/resume only mark the engine unusable/usable.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from engines.distributed import resolve_dtype
from engines.rollout import probe_vllm
from engines.rollout.base import Completion, RolloutEngine, RolloutEngineError, SamplingParams, finish_reason
from engines.rollout.constrained import ConstraintError
from engines.training.fsdp.lora import write_adapter

TRANSFER_BACKEND = "tandem-inproc"
CPU_PREFILL_TOKENS = 65536  # prompt tokens one vLLM step takes on CPU (see __init__)
LORA_ID = 1  # one adapter per engine: the job's


def to_vllm_sampling_params(
    params: SamplingParams, stop_token_ids: list[int], seed: int | None, allowed_ids: list[int] | None = None
) -> Any:
    """One request's vllm.SamplingParams (n is handled by repeating the prompt)."""
    from vllm import SamplingParams as VLLMSamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    structured = (
        None if params.constraint is None else StructuredOutputsParams(grammar=params.constraint.grammar)
    )
    return VLLMSamplingParams(
        structured_outputs=structured,
        allowed_token_ids=allowed_ids if structured is not None else None,
        n=1,
        max_tokens=params.max_new_tokens,
        temperature=params.temperature,  # 0 is greedy in vLLM too
        top_p=params.top_p,
        top_k=params.top_k if params.top_k > 0 else -1,  # vLLM's "whole vocabulary"
        stop_token_ids=stop_token_ids,
        seed=seed,
        logprobs=0,  # the sampled token's log-prob only
        detokenize=False,
        skip_special_tokens=False,
    )


def completion_from_vllm(output: Any) -> Completion:
    """One vllm CompletionOutput (generated with logprobs=0) as a Completion."""
    token_ids = [int(t) for t in output.token_ids]
    if output.logprobs is None or len(output.logprobs) != len(token_ids):
        raise RolloutEngineError(
            f"vllm returned {0 if output.logprobs is None else len(output.logprobs)} log-probs for "
            f"{len(token_ids)} tokens: generate with logprobs=0"
        )
    log_probs = [float(step[token].logprob) for step, token in zip(output.logprobs, token_ids, strict=True)]
    reason = output.finish_reason
    aborted = " (the engine was stopped or put to sleep mid-generation)"
    return Completion(token_ids, log_probs, finish_reason("vllm", reason, reason, aborted))


def register_inproc_transfer_backend() -> None:
    """Register "tandem-inproc" with vLLM's weight-transfer factory (once per process)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    if TRANSFER_BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(
            TRANSFER_BACKEND, "engines.rollout.vllm_transfer", "InProcessWeightTransferEngine"
        )


def check_cpu_head_size(model_path: str | Path) -> None:
    """vLLM's CPU attention has kernels for some head sizes only; others start, then die on the
    first request. Refuse them up front."""
    import json

    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    cfg = json.loads((Path(model_path) / "config.json").read_text())
    head_size = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    supported = CPUAttentionBackend.get_supported_head_sizes()
    if head_size not in supported:
        raise RolloutEngineError(
            f"vllm's CPU attention supports head sizes {supported}; model folder '{model_path}' has "
            f"head size {head_size}: use rollout backend 'hf' for it"
        )


VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # the values vLLM's LoRAConfig.max_lora_rank takes


def vllm_max_lora_rank(rank: int) -> int:
    """The smallest `max_lora_rank` vLLM accepts that serves an adapter of `rank` (4 -> 8)."""
    fits = [r for r in VLLM_LORA_RANKS if r >= rank]
    if not fits:
        raise RolloutEngineError(
            f"vllm serves LoRA adapters up to rank {VLLM_LORA_RANKS[-1]}; this one's is {rank}"
        )
    return fits[0]


class VLLMRolloutEngine(RolloutEngine):
    backend = "vllm"

    def __init__(
        self,
        model_path: str | Path,
        device: str = "cpu",
        dtype: str = "auto",
        *,
        max_model_len: int | None = None,
        kv_cache_gib: int = 1,
        seed: int = 0,
        eos_token_ids: list[int] | None = None,
        max_lora_rank: int | None = None,
        **llm_args: Any,
    ) -> None:
        problem = probe_vllm()
        if problem is not None:
            raise ImportError(problem)
        super().__init__(model_path, eos_token_ids)
        self.device = torch.device(device)
        self.dtype = resolve_dtype(dtype, device)
        self._asleep = False
        self._updating = False
        # The served adapter's folder in RAM (/dev/shm where writable) and its request; re-adding the
        # same LoRA id with `load_inplace` replaces the served adapter's weights.
        self._adapter_folder: Path | None = None
        self._lora: Any = None
        self.has_tokenizer = any(
            (Path(model_path) / f).exists() for f in ("tokenizer.json", "tokenizer_config.json")
        )
        if max_lora_rank is not None:
            llm_args = {
                **llm_args,
                "enable_lora": True,
                "max_lora_rank": vllm_max_lora_rank(max_lora_rank),
                "max_loras": 1,
            }
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        # Its INFO lines and warnings would flood the worker's log on every start.
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
        if self.device.type == "cpu":
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(kv_cache_gib))
            check_cpu_head_size(model_path)
            # A chunked prefill rewinds each seeded request's generator, which CPU generators cannot
            # do (the engine dies): take a whole batch's prompts in one step.
            llm_args = {"max_num_batched_tokens": CPU_PREFILL_TOKENS, **llm_args}
        from vllm import LLM
        from vllm.config import WeightTransferConfig

        register_inproc_transfer_backend()
        # vLLM's CPU worker replaces torch.set_num_threads process-wide and may lower the thread
        # count; the trainer beside it in this process keeps both.
        set_num_threads, threads = torch.set_num_threads, torch.get_num_threads()
        try:
            self._llm = LLM(
                model=str(model_path),
                skip_tokenizer_init=not self.has_tokenizer,
                dtype=str(self.dtype).removeprefix("torch."),
                enforce_eager=True,
                max_model_len=max_model_len,
                seed=seed,
                logprobs_mode="processed_logprobs",
                weight_transfer_config=WeightTransferConfig(backend=TRANSFER_BACKEND),
                enable_sleep_mode=self.device.type == "cuda",
                **llm_args,
            )
        except Exception as exc:
            raise RolloutEngineError(f"vllm could not start on model folder '{model_path}': {exc}") from exc
        finally:
            torch.set_num_threads = set_num_threads
            torch.set_num_threads(threads)

    def _generate(self, rows: list[list[int]], params: SamplingParams) -> list[Completion]:
        if params.constraint is not None and not self.has_tokenizer:
            raise ConstraintError("response_format", "the vllm engine enforces constraints with the model's tokenizer, "
                                  "and this model folder has none")  # fmt: skip
        stop_ids = self.stop_ids(params)
        allowed = None if params.constraint is None else self._allowed_ids(stop_ids)
        sampling = [
            to_vllm_sampling_params(
                params, stop_ids, None if params.seed is None else params.seed + row, allowed
            )
            for row in range(len(rows))
        ]
        try:
            outputs = self._llm.generate(
                [{"prompt_token_ids": row} for row in rows],
                sampling,
                use_tqdm=False,
                lora_request=self._lora,
            )
        except Exception as exc:
            raise RolloutEngineError(f"vllm generate failed: {type(exc).__name__}: {exc}") from exc
        return [completion_from_vllm(out.outputs[0]) for out in outputs]

    def _allowed_ids(self, stop_ids: list[int]) -> list[int]:
        """All tokens but the special ones other than the stop tokens, as the hf engine's
        GrammarMask bans them (their text would re-tokenise as the special token)."""
        tokenizer = self._llm.get_tokenizer()
        banned = set(tokenizer.all_special_ids) - set(stop_ids)
        return [i for i in range(len(tokenizer)) if i not in banned]

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load one bucket; the first bucket of a sync opens vLLM's weight-update session."""
        bucket = [(name, tensor.detach().to(self.device)) for name, tensor in named_tensors]
        if self._asleep:
            self._llm.wake_up(tags=["weights"])  # the weights must be resident to be overwritten
        if not self._updating:
            self._llm.start_weight_update()
            self._updating = True
        try:
            self._llm.update_weights({"update_info": {"named_tensors": bucket}})
        except Exception as exc:
            self._updating = False  # vLLM's worker has closed the session; the next bucket opens one
            raise RolloutEngineError(
                f"vllm could not load a weight bucket of {len(bucket)} tensors (HF names such as "
                f"'{bucket[0][0]}'); the rollout model is now part old, part new: sync it again: {exc}"
            ) from exc

    def load_adapter(self, config: dict, named_tensors: list[tuple[str, torch.Tensor]]) -> None:
        from vllm.lora.request import LoRARequest

        if self._adapter_folder is None:
            shm = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
            self._adapter_folder = Path(tempfile.mkdtemp(prefix="tandem-lora-", dir=shm))
        try:
            write_adapter(self._adapter_folder, dict(named_tensors), config)
            self._lora = LoRARequest("tandem", LORA_ID, str(self._adapter_folder), load_inplace=True)
            engine = self._llm.llm_engine
            if not engine.add_lora(self._lora) or LORA_ID not in engine.list_loras():
                raise RuntimeError("vLLM did not register the adapter")
        except Exception as exc:
            raise RolloutEngineError(
                f"vllm could not load the LoRA adapter: {type(exc).__name__}: {exc}"
            ) from exc

    def finish_update(self) -> int:
        if self._updating:
            self._llm.finish_weight_update(weight_version=str(self.weight_version + 1))
            self._updating = False
        self._llm.reset_prefix_cache()  # cached prefixes hold keys/values of the old weights
        return super().finish_update()

    def release_memory(self) -> None:
        """CUDA: sleep(level=1). CPU: vLLM has no sleep mode; the engine is only marked released."""
        if not self.is_released and self.device.type == "cuda":
            self._llm.sleep(level=1)
            self._asleep = True
        super().release_memory()

    def resume_memory(self) -> None:
        if self._asleep:
            self._llm.wake_up()
            self._asleep = False
        super().resume_memory()

    def shutdown(self) -> None:
        llm, self._llm = self._llm, None
        if self._adapter_folder is not None:
            shutil.rmtree(self._adapter_folder, ignore_errors=True)
        if llm is not None:
            llm.llm_engine.engine_core.shutdown()
