"""The rollout-engine interface: batched generation, and weights in as (HF name, tensor) streams.

Every Completion carries the `weight_version` that produced it, so the trainer can tell how stale
a sample is.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

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
    extras: dict[str, float] = field(default_factory=dict)


class RolloutEngineError(RuntimeError):
    """A rollout engine was used in a state that cannot serve the call (e.g. memory released)."""


class RolloutEngine(ABC):
    """Batched generation plus in-process weight updates. `pad_token_id` pads the batches built from
    its completions; `dtype` is what `update_weights` expects (None: the engine casts itself)."""

    weight_version: int = 0
    pad_token_id: int = 0
    dtype: torch.dtype | None = None

    @abstractmethod
    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        """`len(prompts) * params.n` completions, prompt-major."""

    @abstractmethod
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load a (partial) stream of HF-named full tensors; call `finish_update` after the last."""

    def load_adapter(self, config: dict, named_tensors: list[tuple[str, torch.Tensor]]) -> None:
        """Serve this LoRA adapter (PEFT config and tensors, fp32) from the next generate on; call
        `finish_update` after it."""
        raise RolloutEngineError(f"rollout backend {type(self).__name__} cannot serve LoRA adapters")

    @abstractmethod
    def finish_update(self) -> int:
        """Mark the end of one whole sync (several update_weights buckets): bumps weight_version."""

    def memory_is_short(self) -> bool:
        """Whether releasing memory between calls is worth its cost now (rollout.free_cache_after_generate
        left unset). Engines whose cache holds most of the device always release."""
        return True

    @abstractmethod
    def release_memory(self) -> None:
        """Drop what can be rebuilt (KV cache; on GPU also weights); generate raises until resumed."""

    @abstractmethod
    def resume_memory(self) -> None:
        """Undo release_memory."""

    @property
    @abstractmethod
    def is_released(self) -> bool: ...
