"""The training-engine interface: the only way a training role (actor, critic, reference, SFT)
touches a model.

A batch is a TensorDict over samples: input_ids / attention_mask [B, T] (prompt left-padded, response
right-padded, T = P + R), optional position_ids, responses / response_mask [B, R], optional
needs_backward [B] (False: the row's loss has zero gradient, so it runs forward only), optional
scored [B] (False: a row left out of the loss, its response mask 0, not counted in N_seqs either), and
whatever the loss reads.

The loss contract: `loss_fn(micro_batch, outputs, counts)` runs once per micro-batch on [mb, R]
outputs ("log_probs", "entropy" when asked, "values" for a value head) and normalises by `counts`,
summed over the whole batch and every dp rank, so losses, gradients and metrics add up to the global
batch's whatever the micro-batch split or dp size; a metric named `*_max` is a maximum instead.
Gradients add up over calls until `optimizer_step`: a caller that accumulates several calls into one
step passes the counts of all of them (`GlobalCounts.of`) to each; without `counts` a call is one
whole optimizer batch. Plain-sum losses (the Tinker API's) read no counts.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field

import torch
from tensordict import TensorDict

from schema.engine import OptimizerConfig


@dataclass(frozen=True)
class GlobalCounts:
    """Sizes of the global batch of one forward_backward_batch call, summed over all dp ranks."""

    tokens: int  # sum of response_mask
    sequences: int  # number of samples (rows)
    response_width: int  # R, the padded response length (the constant of seq-mean-token-sum-norm)

    @classmethod
    def of(cls, batches: Sequence[TensorDict]) -> GlobalCounts:
        """The counts of several calls' rows taken together (all of them, over every rank)."""
        return cls(
            tokens=int(sum(int(b["response_mask"].sum()) for b in batches)),
            sequences=sum(loss_rows(b) for b in batches),
            response_width=max(int(b["response_mask"].shape[1]) for b in batches),
        )


MAX_SUFFIX = "_max"
NEEDS_BACKWARD = "needs_backward"  # the optional batch keys of the module docstring
SCORED = "scored"


def loss_rows(batch: TensorDict) -> int:
    """The rows a loss averages over (N_seqs): all but those flagged not SCORED."""
    return int(batch[SCORED].sum()) if SCORED in batch.keys() else int(batch.batch_size[0])


def combine_metric(metrics: dict[str, float], key: str, value: float) -> None:
    """Fold one micro-batch's metric into `metrics`: a sum, or the maximum for a `_max` name."""
    if key.endswith(MAX_SUFFIX):
        metrics[key] = max(metrics.get(key, float("-inf")), float(value))
    else:
        metrics[key] = metrics.get(key, 0.0) + float(value)


LossFn = Callable[[TensorDict, dict[str, torch.Tensor], GlobalCounts], tuple[torch.Tensor, dict[str, float]]]


@dataclass
class EngineOutput:
    """Per-sample outputs in the batch's original order, and metrics summed over micro-batches and ranks."""

    outputs: dict[str, torch.Tensor] = field(default_factory=dict)  # e.g. "log_probs": [B, R]
    metrics: dict[str, float] = field(default_factory=dict)


class TrainEngine(ABC):
    """A sharded model with its optimizer and LR schedule. See the module docstring for the contract."""

    dp_rank: int
    dp_size: int
    is_collect_rank: bool
    device: torch.device  # the compute device; `to(str(device))` onloads

    @abstractmethod
    def initialize(self) -> None:
        """Build the model (and optimizer, scheduler) from the configured HF folder, sharded."""

    @abstractmethod
    def train_mode(self) -> AbstractContextManager[None]:
        """Onload what is offloaded and set train mode; offload again on exit when configured."""

    @abstractmethod
    def eval_mode(self) -> AbstractContextManager[None]:
        """Onload parameters and set eval mode; offload again on exit when configured."""

    @abstractmethod
    def forward_backward_batch(
        self,
        batch: TensorDict,
        loss_fn: LossFn | None,
        forward_only: bool = False,
        compute_entropy: bool = False,
        temperature: float = 1.0,
        counts: GlobalCounts | None = None,
    ) -> EngineOutput:
        """Run the batch in micro-batches; back-propagate `loss_fn` unless forward_only. Log-probs are
        of logits / temperature (a rollout's sampling distribution); `counts`: module docstring."""

    @abstractmethod
    def optimizer_zero_grad(self) -> None: ...

    @abstractmethod
    def optimizer_step(self, params: OptimizerConfig | None = None) -> float:
        """Clip and step; returns the global grad norm before clipping (a non-finite one skips the step).
        `params`: AdamW's settings for this step only; None = the configured ones and the schedule's lr."""

    @abstractmethod
    def lr_scheduler_step(self) -> float:
        """Advance the schedule; returns the new learning rate."""

    @property
    @abstractmethod
    def learning_rate(self) -> float:
        """The current learning rate (schedule applied); 0.0 for an engine without an optimizer."""

    @abstractmethod
    def set_learning_rate(self, lr: float) -> None:
        """Change the base learning rate (a hyper-parameter edit); the schedule's factor still applies."""

    @abstractmethod
    def get_per_tensor_param(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF state-dict name, full tensor), one parameter at a time, gathered lazily. With LoRA
        (`adapter_config()` not None) only the adapter's tensors, in PEFT's saved names."""

    def adapter_config(self) -> dict | None:
        """PEFT's adapter_config.json of the adapter the stream carries; None when it is the whole model."""
        return None

    def adapters_off(self) -> AbstractContextManager[None]:
        """Compute as the base model, adapters switched off (the reference policy of a LoRA engine)."""
        raise RuntimeError(f"{type(self).__name__} has no LoRA adapters to switch off")

    @abstractmethod
    def to(self, device: str, model: bool = True, optimizer: bool = True) -> None:
        """Move parameters and/or optimizer state (offload to 'cpu', onload to the compute device)."""

    @abstractmethod
    def save_checkpoint(self, path: str, step: int) -> None:
        """Model, optimizer, scheduler, step and RNG, atomically (temporary folder, then rename)."""

    @abstractmethod
    def load_checkpoint(self, path: str, optimizer: bool = True) -> int:
        """Restore what save_checkpoint wrote; returns the step. optimizer=False restores the weights
        only, leaving the optimizer state and the schedule as they are."""

    @abstractmethod
    def export_hf(self, path: str, merged: bool = False) -> None:
        """Write the full weights as a Hugging Face folder that `from_pretrained` loads (policy only);
        with LoRA, a PEFT adapter folder, plus the merged model under `path/merged` when `merged`."""
