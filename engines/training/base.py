"""The training-engine interface: the only way a training role (actor, critic, reference, SFT)
touches a model.

Batch layout (a TensorDict, batch dimension 0 = samples):
    input_ids       [B, T]  prompt (left-padded) followed by response (right-padded), T = P + R
    attention_mask  [B, T]  1 on real tokens
    position_ids    [B, T]  optional; derived from attention_mask when absent
    responses       [B, R]  the response tokens (the last R columns of input_ids)
    response_mask   [B, R]  1 on response tokens that count (loss / outputs)
    needs_backward  [B]     optional bool; False marks a row whose loss is known to have zero gradient
                            (a zero advantage on every token of a plain policy loss): the engine runs
                            it forward only. Its outputs and metrics are unchanged, and so is the
                            gradient, which it never contributed to.
plus whatever the loss function reads (advantages, old_log_probs, ...), all [B, R] or [B].

The loss contract. `forward_backward_batch` calls `loss_fn(micro_batch, outputs, counts)` once per
micro-batch. `outputs` holds [mb, R] tensors aligned with `micro_batch["responses"]`: "log_probs"
(always), "entropy" (when asked), "values" (value-head engines). `counts` are global: summed over the
whole batch of this call and over every data-parallel rank. The loss function normalises by them, so
the sum of its losses over micro-batches and ranks is the loss of the global batch, and gradients do
not depend on the micro-batch split, dynamic batching or the dp size. The metrics it returns are
additive in the same way (already divided by global counts); the engine sums them over micro-batches
and ranks, so a logged loss is on the scale of the loss that was back-propagated. A metric whose
name ends in `_max` is a maximum instead: the engine keeps the largest value (`combine_metric`).

Gradients accumulated over several calls. Gradients add up from one `forward_backward_batch` to the
next until `optimizer_step` (which zeroes them), so one optimizer step may take its batch in several
calls: the RL loop makes one call per step (its mini-batch), a low-level client (the Tinker API) as
many as it likes. The counts must then be those of the WHOLE accumulated batch, not of one call, or each call
would be normalised as if it were the whole batch: the caller states them (`counts=`, built with
`GlobalCounts.of` over every call's rows, on every rank), and the engine hands them to the loss as
they are instead of counting the call's rows. N calls with 1/N of the batch each then give the
gradient of one call with the whole batch, in every aggregation mode (tests/test_accumulation.py;
two ranks: tests/test_train_engine_dist.py).
Without `counts` a call is one whole optimizer batch (the RL loop's case). Losses that are plain sums (the
Tinker API's built-in losses) do not read the counts and accumulate either way.
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
        """The counts of several calls' rows taken together (all of them, over every rank): what a
        caller that accumulates gradients over those calls passes as `counts` to each."""
        return cls(
            tokens=int(sum(int(b["response_mask"].sum()) for b in batches)),
            sequences=sum(int(b.batch_size[0]) for b in batches),
            response_width=max(int(b["response_mask"].shape[1]) for b in batches),
        )


MAX_SUFFIX = "_max"
NEEDS_BACKWARD = "needs_backward"  # the optional batch key of the module docstring


def combine_metric(metrics: dict[str, float], key: str, value: float) -> None:
    """Fold one micro-batch's (or mini-batch's) metric into `metrics`: a sum, or for a name ending in
    `_max` the maximum."""
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
        """Run the batch in micro-batches; back-propagate `loss_fn` unless forward_only. Gradients add
        to those of earlier calls since the last optimizer step.

        Log-probs are of logits / temperature, so that they match the sampling distribution of a
        rollout at that temperature. `counts`: the global counts of the whole accumulated batch when
        this call is one of several before an optimizer step (module docstring); None = this call's.
        """

    @abstractmethod
    def optimizer_zero_grad(self) -> None: ...

    @abstractmethod
    def optimizer_step(self, params: OptimizerConfig | None = None) -> float:
        """Clip and step; returns the global grad norm before clipping. A non-finite norm skips the step.

        `params`: AdamW's settings for this step only (lr, betas, eps, weight_decay, grad_clip), in
        place of the engine's configured ones and the schedule's learning rate; None = those."""

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
