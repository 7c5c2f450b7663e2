"""Fine-grained training operations: what the RL loop and a low-level client both build on.

`TrainOps` is one training engine's operations for a caller that already holds it in train mode:
`forward_backward` (gradients accumulate over calls until the next step), `optim_step` (with
optional AdamW settings for that step alone; returns the grad norm), `lr_scheduler_step` and
`forward`. The RL loop's update (`workers/training.train_on_batch`) is mini-batches of
`forward_backward` + `optim_step`, then one `lr_scheduler_step`.

`TrainingOperations` is a worker mixin that registers the same operations as worker-group methods
on the "actor" mesh, each in its own train/eval mode, with the loss given by its options
(`schema.losses.LossSpec`), plus `save_state` / `load_state`. A caller that accumulates over
several `forward_backward` calls before one `optim_step` passes the counts of all of them
(`GlobalCounts.of`, the loss contract of engines/base.py), so the gradient is that of one call
with the whole batch. A MESH call pads a batch that does not divide by the dp size with copies of
its first rows, which would count twice here: `forward_backward` is registered with pad=False, and
the group refuses such a batch, naming the dp size.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from tensordict import TensorDict

from engines.base import NEEDS_BACKWARD, EngineOutput, GlobalCounts, LossFn, TrainEngine
from schema.engine import OptimizerConfig
from schema.losses import LossSpec, PolicyLossConfig
from workers.base import Dispatch, Reduce, Worker, register
from workers.batch import Batch, sampling_of


class TrainOps:
    """One engine's operations; the caller holds it in train mode (see the module docstring).

    Each takes an optional adapter key: None acts on the engine's own weights (an RL job's), a key
    on that adapter of an engine that holds many on one base (engines/adapter_engine.py)."""

    def __init__(self, engine: TrainEngine) -> None:
        self.engine = engine
        self.pending_calls = 0  # forward_backward calls whose gradients wait for the next step

    def forward_backward(
        self,
        tensors: TensorDict,
        loss_fn: LossFn,
        counts: GlobalCounts | None = None,
        compute_entropy: bool = False,
        temperature: float = 1.0,
        adapter: str | None = None,
    ) -> EngineOutput:
        """Add this batch's gradient; `counts`: the whole accumulated batch's (engines/base.py)."""
        out = self.engine.forward_backward_batch(
            tensors,
            loss_fn,
            compute_entropy=compute_entropy,
            temperature=temperature,
            counts=counts,
            **_on(adapter),
        )
        self.pending_calls += 1
        return out

    def optim_step(self, params: OptimizerConfig | dict | None = None, adapter: str | None = None) -> float:
        """Step on the accumulated gradient and zero it; returns the global grad norm before clipping.
        `params`: AdamW's settings for this step (an adapter engine also takes the SDK's AdamParams)."""
        self.pending_calls = 0
        return self.engine.optimizer_step(params, **_on(adapter))

    def lr_scheduler_step(self) -> float:
        return self.engine.lr_scheduler_step()

    def forward(
        self,
        tensors: TensorDict,
        compute_entropy: bool = False,
        temperature: float = 1.0,
        adapter: str | None = None,
    ) -> dict[str, torch.Tensor]:
        """Per-token outputs ([B, R] log_probs, entropy when asked, values of a value engine)."""
        out = self.engine.forward_backward_batch(
            tensors,
            None,
            forward_only=True,
            compute_entropy=compute_entropy,
            temperature=temperature,
            **_on(adapter),
        )
        return out.outputs

    def save_state(
        self, path: str, step: int = 0, adapter: str | None = None, optimizer: bool = True
    ) -> None:
        """The weights (an adapter's: that adapter), optimizer state and step under `path`."""
        if adapter is None:
            self.engine.save_checkpoint(path, step)
        else:
            self.engine.save_checkpoint(path, step, adapter=adapter, optimizer=optimizer)

    def load_state(self, path: str, optimizer: bool = True, adapter: str | None = None) -> int:
        """Restore what save_state wrote (optimizer=False: the weights only); returns its step."""
        return self.engine.load_checkpoint(path, optimizer=optimizer, **_on(adapter))


def _on(adapter: str | None) -> dict[str, str]:
    """The adapter keyword for an engine that holds adapters; none for the engine's own weights."""
    return {} if adapter is None else {"adapter": adapter}


@dataclass
class PreparedLoss:
    """A loss ready for `forward_backward`: the batch it reads, the LossFn and how to run the forward."""

    tensors: TensorDict
    loss_fn: LossFn
    compute_entropy: bool = False
    temperature: float = 1.0


def prepare_loss(batch: Batch, spec: LossSpec) -> PreparedLoss:
    """The LossFn of `spec` and the forward it needs, the same for the RL update and a client call."""
    from workers.losses import make_loss, rows_with_gradient

    if not isinstance(spec, PolicyLossConfig):
        return PreparedLoss(batch.tensors, make_loss(spec))
    loss_fn = make_loss(spec)
    if "old_log_probs" not in batch.tensors.keys():
        loss_fn = old_log_probs_from_current(loss_fn)
    tensors = batch.tensors
    # Rows with a zero advantage everywhere run forward only (metrics), never backward.
    with_gradient = rows_with_gradient(spec, tensors)
    if with_gradient is not None:
        tensors = tensors.clone(recurse=False)
        tensors[NEEDS_BACKWARD] = with_gradient
    # Entropy is always computed so the dashboard's Entropy chart has actor/entropy; it joins the
    # loss only with a non-zero entropy_coeff.
    return PreparedLoss(tensors, loss_fn, compute_entropy=True, temperature=temperature_of(batch))


def old_log_probs_from_current(loss_fn: LossFn) -> LossFn:
    """Wrap a policy loss for a single on-policy step: old log-probs are the current ones, detached.

    Only valid while the policy has not moved since the batch was sampled (the first optimizer step
    of an update: one mini-batch, one epoch; the trainer decides that). The policy loss then
    measures the rollout engine's mismatch and applies the rollout correction against these values.
    """

    def wrapped(micro, outputs, counts):
        micro["old_log_probs"] = outputs["log_probs"].detach()
        return loss_fn(micro, outputs, counts)

    return wrapped


def temperature_of(batch: Batch) -> float:
    """The sampling temperature the batch's log-probs are taken at (greedy and SFT: 1)."""
    params = sampling_of(batch)
    temperature = params.temperature if params is not None else 1.0
    return temperature if temperature > 0 else 1.0  # greedy: log-probs of the plain model


class TrainingOperations(Worker):
    """Mixin of a training role: its engine's operations as worker-group methods on the "actor" mesh.

    The role sets `self.ops = TrainOps(engine)` once its engine is built; its job checkpoints go
    under `<folder>/<checkpoint_name>`."""

    ops: TrainOps
    checkpoint_name: ClassVar[str]

    def after_load_checkpoint(self) -> None:
        """What the role does once its engine holds restored weights (the hybrid worker syncs them)."""

    @register(Dispatch.MESH, mesh="actor", reduce=Reduce.GLOBAL, pad=False)
    def forward_backward(
        self, batch: Batch, loss: LossSpec, counts: GlobalCounts | None = None
    ) -> dict[str, float]:
        """Add the batch's gradient under `loss`, no optimizer step; metrics summed over ranks."""
        prepared = prepare_loss(batch, loss)
        with self.ops.engine.train_mode():
            out = self.ops.forward_backward(
                prepared.tensors,
                prepared.loss_fn,
                counts,
                compute_entropy=prepared.compute_entropy,
                temperature=prepared.temperature,
            )
        return out.metrics

    @register(Dispatch.ONE_TO_ALL, reduce=Reduce.GLOBAL)
    def optim_step(self, params: OptimizerConfig | None = None) -> float:
        """One optimizer step on the accumulated gradient (AdamW settings for this step: `params`);
        the global grad norm before clipping."""
        with self.ops.engine.train_mode():
            return self.ops.optim_step(OptimizerConfig.model_validate(params) if params else None)

    @register(Dispatch.ONE_TO_ALL, reduce=Reduce.GLOBAL)
    def lr_scheduler_step(self) -> float:
        """Advance the learning-rate schedule; the new learning rate."""
        return self.ops.lr_scheduler_step()

    @register(Dispatch.MESH, mesh="actor")
    def forward(self, batch: Batch) -> Batch:
        """Adds log_probs [B, R] at the batch's sampling temperature (values [B, R] for a critic)."""
        with self.ops.engine.eval_mode():
            outputs = self.ops.forward(batch.tensors, temperature=temperature_of(batch))
        tensors = batch.tensors.clone(recurse=False)
        for key, value in outputs.items():
            tensors[key] = value
        return Batch(tensors, batch.non_tensors, batch.meta)

    @register(Dispatch.ONE_TO_ALL, reduce=Reduce.RANK_ZERO)
    def save_state(self, path: str, step: int) -> None:
        """The engine's weights, optimizer, schedule and RNG under `path` (atomically)."""
        self.ops.save_state(path, step)

    @register(Dispatch.ONE_TO_ALL, reduce=Reduce.RANK_ZERO)
    def load_state(self, path: str, optimizer: bool = True) -> int:
        """Restore what save_state wrote (optimizer=False: the weights only); returns its step."""
        return self.ops.load_state(path, optimizer)

    # ---- the job's checkpoints and hyper-parameter edits ----------------------------------------

    @register(Dispatch.ONE_TO_ALL, reduce=Reduce.RANK_ZERO)
    def save_checkpoint(self, folder: str, step: int) -> None:
        """This role's engine state in the job checkpoint `folder` (under its checkpoint_name)."""
        self.save_state(f"{folder}/{self.checkpoint_name}", step)

    @register(Dispatch.ONE_TO_ALL, reduce=Reduce.RANK_ZERO)
    def load_checkpoint(self, folder: str) -> int:
        """Restore this role from the job checkpoint `folder`; returns the checkpoint's step."""
        step = self.load_state(f"{folder}/{self.checkpoint_name}")
        self.after_load_checkpoint()
        return step

    @register(Dispatch.ONE_TO_ALL, reduce=Reduce.RANK_ZERO)
    def set_hyperparameters(self, lr: float | None = None) -> None:
        """A live edit: the base learning rate (the schedule's factor still applies)."""
        if lr is not None:
            self.ops.engine.set_learning_rate(lr)
