"""The rollout-engine interface: batched generation, and weights in as (HF name, tensor) streams.

Every Completion carries the `weight_version` that produced it, so the trainer can tell how stale
a sample is.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field

from engines.rollout.constrained import Constraint

if TYPE_CHECKING:  # torch only in annotations: the backend registry imports without it
    import torch


class SamplingKnobs(BaseModel):
    """The sampling settings a job chooses (JobSpec.rollout inherits them)."""

    model_config = ConfigDict(extra="forbid")

    temperature: float = Field(1.0, ge=0, le=100, description="0 means greedy decoding")
    top_p: float = Field(1.0, gt=0, le=1, description="nucleus sampling mass; 1 disables it")
    top_k: int = Field(
        -1, ge=-1, le=1_000_000, description="keep the k most likely tokens; -1 (or 0) disables it"
    )


class SamplingParams(SamplingKnobs):
    """How to sample. `n` completions per prompt, returned prompt-major (all of prompt 0, then 1...)."""

    max_new_tokens: int = Field(16, gt=0, description="hard cap on generated tokens per completion")
    stop_token_ids: list[int] = Field(default_factory=list, description="besides the model's EOS")
    n: int = Field(1, ge=1, description="completions per prompt")
    seed: int | None = Field(None, description="makes sampling reproducible")
    constraint: Constraint | None = Field(
        None, description="a grammar the tokens must follow (constrained decoding)"
    )


FinishReason = Literal["stop", "length"]


@dataclass
class Completion:
    """One generated continuation; a stop token that ended it is included.

    `log_probs[i]` is under the distribution `token_ids[i]` was sampled from: logits / temperature
    (0: / 1), restricted to the top-k / top-p set (and a `constraint`'s allowed tokens), renormalised;
    with temperature 1 and no filtering, the plain model log-probability the trainer recomputes.
    """

    token_ids: list[int]
    log_probs: list[float]
    finish_reason: FinishReason
    weight_version: int = 0
    prompt_index: int = 0


class RolloutEngineError(RuntimeError):
    """A rollout engine was used in a state that cannot serve the call (e.g. memory released)."""


def read_special_token_ids(model_path: str | Path) -> tuple[list[int], int]:
    """(EOS ids, pad id) from generation_config.json, then config.json (no slow tokenizer load); the
    pad id falls back to the first EOS id."""
    eos: int | list[int] | None = None
    pad: int | None = None
    for name in ("generation_config.json", "config.json"):
        path = Path(model_path) / name
        if not path.exists():
            continue
        cfg = json.loads(path.read_text())
        eos = eos if eos is not None else cfg.get("eos_token_id")
        pad = pad if pad is not None else cfg.get("pad_token_id")
    if eos is None:
        raise ValueError(
            f"model folder '{model_path}' names no eos_token_id in generation_config.json or config.json"
        )
    eos_ids = [eos] if isinstance(eos, int) else list(eos)
    return eos_ids, eos_ids[0] if pad is None else pad


def finish_reason(backend: str, reason: object, kind: object, abort_detail: str) -> FinishReason:
    """A backend's finish reason `kind` as ours; an abort or an unknown `reason` raises."""
    if kind in ("stop", "length"):
        return kind
    if kind == "abort":
        raise RolloutEngineError(f"{backend} aborted a request{abort_detail}")
    raise RolloutEngineError(f"{backend} returned an unfinished or unknown finish_reason: {reason!r}")


class RolloutEngine(ABC):
    """Batched generation plus in-process weight updates. `pad_token_id` pads the batches built from
    its completions; `dtype` is what `update_weights` expects (None: the engine casts itself).
    A backend implements `_generate` on the expanded rows and the weight loads; the released flag,
    the version counter and the checks every backend shares live here."""

    backend: ClassVar[str] = ""  # names the engine in errors
    weight_version: int = 0
    pad_token_id: int = 0
    dtype: torch.dtype | None = None
    _released: bool = False

    def __init__(
        self, model_path: str | Path, eos_token_ids: list[int] | None = None, pad_token_id: int | None = None
    ) -> None:
        """The stop and pad tokens: given, else read from the model folder."""
        folder_eos, folder_pad = read_special_token_ids(model_path)
        self.eos_token_ids = list(eos_token_ids) if eos_token_ids is not None else folder_eos
        self.pad_token_id = pad_token_id if pad_token_id is not None else folder_pad

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        """`len(prompts) * params.n` completions, prompt-major."""
        if self.is_released:
            raise RolloutEngineError(
                f"{self.backend} rollout engine memory is released: call resume_memory() before generate()"
            )
        if not prompts:
            return []
        if any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token; got an empty prompt")
        completions = self._generate([list(p) for p in prompts for _ in range(params.n)], params)
        for row, completion in enumerate(completions):
            completion.prompt_index, completion.weight_version = row // params.n, self.weight_version
        return completions

    @abstractmethod
    def _generate(self, rows: list[list[int]], params: SamplingParams) -> list[Completion]:
        """One completion per row, each prompt repeated params.n times (its prompt_index and
        weight_version are set by `generate`)."""

    def stop_ids(self, params: SamplingParams) -> list[int]:
        """The tokens that end a completion: the model's EOS and the call's own."""
        return sorted(set(self.eos_token_ids) | set(params.stop_token_ids))

    @abstractmethod
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load a (partial) stream of HF-named full tensors; call `finish_update` after the last."""

    def load_adapter(self, config: dict, named_tensors: list[tuple[str, torch.Tensor]]) -> None:
        """Serve this LoRA adapter (PEFT config and tensors, fp32) from the next generate on; call
        `finish_update` after it."""
        raise RolloutEngineError(f"rollout backend {type(self).__name__} cannot serve LoRA adapters")

    def finish_update(self) -> int:
        """Mark the end of one whole sync (several update_weights buckets): bumps weight_version."""
        self.weight_version += 1
        return self.weight_version

    def memory_is_short(self) -> bool:
        """Whether releasing memory between calls is worth its cost now (rollout.free_cache_after_generate
        left unset). Engines whose cache holds most of the device always release."""
        return True

    def release_memory(self) -> None:
        """Drop what can be rebuilt (KV cache; on GPU also weights); generate raises until resumed.
        A backend frees its memory when not yet released, then calls this."""
        self._released = True

    def resume_memory(self) -> None:
        """Undo release_memory."""
        self._released = False

    @property
    def is_released(self) -> bool:
        return self._released
