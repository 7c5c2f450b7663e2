"""Fine-grained training operations: what the RL loop, a low-level client and the Tinker host build on.

`TrainOps` is one engine's operations, each with an optional adapter key (an engine holding many
adapters); the RL update (`train_on_batch`) is mini-batches of its `forward_backward` + `optim_step`
in a seeded order, the learning-rate schedule advancing once per call. `TrainingOperations` registers them as worker-group methods. A caller accumulating over
several `forward_backward` calls passes the counts of all of them (`GlobalCounts.of`); padding rows
would count twice in a gradient, hence pad=False. Torch is imported where used: the API process binds
the session host's methods through this module.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

from schema.engine import OptimizerConfig
from schema.losses import LossSpec, PolicyLossConfig
from schema.workers import UpdateSchedule
from workers.base import Dispatch, Reduce, Worker, register

if TYPE_CHECKING:
    import torch
    from tensordict import TensorDict

    from engines.training.base import EngineOutput, GlobalCounts, LossFn, TrainEngine
    from workers.batch import Batch


class TrainOps:
    """One engine's operations; the adapter key None acts on the engine's own weights (an RL job's),
    a key on that adapter of an engine that holds many on one base (engines/training/adapter_engine.py)."""

    def __init__(self, engine: TrainEngine) -> None:
        self.engine = engine

    def forward_backward(
        self,
        tensors: TensorDict,
        loss_fn: LossFn,
        counts: GlobalCounts | None = None,
        compute_entropy: bool = False,
        temperature: float = 1.0,
        adapter: str | None = None,
    ) -> EngineOutput:
        """Add this batch's gradient; `counts`: the whole accumulated batch's (engines/training/base.py)."""
        return self.engine.forward_backward_batch(
            tensors,
            loss_fn,
            compute_entropy=compute_entropy,
            temperature=temperature,
            counts=counts,
            **_on(adapter),
        )

    def optim_step(self, params: OptimizerConfig | dict | None = None, adapter: str | None = None) -> float:
        """Step on the accumulated gradient and zero it; returns the global grad norm before clipping.
        `params`: AdamW's settings for this step (an adapter also takes the SDK's AdamParams)."""
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
        else:  # an adapter may be saved without its optimizer state (a sampler snapshot)
            self.engine.save_checkpoint(path, step, adapter=adapter, optimizer=optimizer)

    def load_state(self, path: str, optimizer: bool = True, adapter: str | None = None) -> int:
        """Restore what save_state wrote (optimizer=False: the weights only); returns its step."""
        return self.engine.load_checkpoint(path, optimizer=optimizer, **_on(adapter))


def _on(adapter: str | None) -> dict[str, str]:
    """The adapter keyword for an engine that holds adapters; none for the engine's own weights."""
    return {} if adapter is None else {"adapter": adapter}


def prepare_loss(batch: Batch, spec: LossSpec) -> tuple[TensorDict, LossFn, dict[str, Any]]:
    """The rows, the LossFn of `spec` and the keywords of the forward it needs (compute_entropy,
    temperature), the same for the RL update and a client call."""
    from engines.training.base import NEEDS_BACKWARD
    from workers.losses import make_loss, rows_with_gradient

    loss_fn = make_loss(spec)
    if not isinstance(spec, PolicyLossConfig):
        return batch.tensors, loss_fn, {}
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
    return tensors, loss_fn, {"compute_entropy": True, "temperature": temperature_of(batch)}


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
    from workers.batch import sampling_of

    params = sampling_of(batch)
    temperature = params.temperature if params is not None else 1.0
    return temperature if temperature > 0 else 1.0  # greedy: log-probs of the plain model


def mini_batches(num_rows: int, dp_size: int, schedule: UpdateSchedule) -> list[list[int]]:
    """Index lists of this rank's mini-batches, all epochs in order."""
    global_size = schedule.mini_batch_size or num_rows * dp_size
    if global_size % dp_size:
        raise ValueError(f"mini_batch_size {global_size} must be a multiple of the dp size {dp_size}")
    local = global_size // dp_size
    if num_rows % local:
        raise ValueError(
            f"this rank holds {num_rows} samples, not a multiple of its mini-batch share {local} "
            f"(mini_batch_size {global_size} over {dp_size} ranks)"
        )
    import torch

    plan: list[list[int]] = []
    for epoch in range(schedule.epochs):
        if schedule.shuffle:
            gen = torch.Generator().manual_seed(schedule.seed * 1000 + epoch)
            order = torch.randperm(num_rows, generator=gen).tolist()
        else:
            order = list(range(num_rows))
        plan.extend(order[i : i + local] for i in range(0, num_rows, local))
    return plan


def train_on_batch(
    engine: TrainEngine, batch: Batch, loss: LossSpec, schedule: UpdateSchedule | dict, prefix: str
) -> dict[str, float]:
    """Run every mini-batch of every epoch under `loss` (built as for a client's forward_backward);
    metrics are averaged over the optimizer steps.

    The engine has already reduced each step's metrics over micro-batches and dp ranks (the loss
    contract of engines/training/base.py), so every rank returns the same, global, metrics."""
    import torch

    from engines.training.base import MAX_SUFFIX, combine_metric

    tensors, loss_fn, options = prepare_loss(batch, loss)
    sums: dict[str, float] = {}
    plan = mini_batches(len(batch), engine.dp_size, UpdateSchedule.model_validate(schedule))
    ops = TrainOps(engine)
    with engine.train_mode():
        lr = engine.learning_rate
        for index in plan:
            out = ops.forward_backward(tensors[torch.tensor(index)], loss_fn, **options)
            for key, value in out.metrics.items():
                name = key if "/" in key else f"{prefix}/{key}"
                if name != key and name in out.metrics:
                    continue  # the loss reports its own total under this name (sft/loss): once, not twice
                combine_metric(sums, name, value)
            norm = ops.optim_step()
            combine_metric(sums, f"{prefix}/grad_norm", norm)
            combine_metric(sums, f"{prefix}/grad_norm_max", norm)  # the largest optimizer step's
        ops.lr_scheduler_step()
    # Averaged over the optimizer steps; maxima (engines/training/base.py) stay maxima.
    metrics = {key: value if key.endswith(MAX_SUFFIX) else value / len(plan) for key, value in sums.items()}
    metrics[f"{prefix}/lr"] = lr
    metrics[f"{prefix}/optimizer_steps"] = float(len(plan))
    return metrics


class TrainingOperations(Worker):
    """Mixin of a training role: its engine's operations as worker-group methods, each with the
    adapter key of TrainOps (an RL role's engine: None). The role sets `self.ops = TrainOps(engine)`
    once its engine is built; its job checkpoints go under `<folder>/<checkpoint_name>`."""

    ops: TrainOps
    checkpoint_name: ClassVar[str]

    def after_load_checkpoint(self) -> None:
        """What the role does once its engine holds restored weights (the hybrid worker syncs them)."""

    @register(Dispatch.MESH, mesh="actor", reduce=Reduce.GLOBAL, pad=False)
    def forward_backward(
        self, batch: Batch, loss: LossSpec, counts: GlobalCounts | None = None, adapter: str | None = None
    ) -> dict[str, float]:
        """Add the batch's gradient under `loss`, no optimizer step; metrics summed over ranks."""
        tensors, loss_fn, options = prepare_loss(batch, loss)
        with self.ops.engine.train_mode():
            return self.ops.forward_backward(tensors, loss_fn, counts, adapter=adapter, **options).metrics

    @register(Dispatch.ONE_TO_ALL, reduce=Reduce.GLOBAL)
    def optim_step(self, params: OptimizerConfig | dict | None = None, adapter: str | None = None) -> float:
        """One optimizer step on the accumulated gradient (AdamW settings for this step: `params`,
        for an adapter also the SDK's AdamParams); the global grad norm before clipping."""
        if isinstance(params, dict) and adapter is None:
            params = OptimizerConfig.model_validate(params)
        with self.ops.engine.train_mode():
            return self.ops.optim_step(params or None, adapter)

    @register(Dispatch.ONE_TO_ALL, reduce=Reduce.GLOBAL)
    def lr_scheduler_step(self) -> float:
        """Advance the learning-rate schedule; the new learning rate."""
        return self.ops.lr_scheduler_step()

    @register(Dispatch.MESH, mesh="actor")
    def forward(self, batch: Batch, adapter: str | None = None) -> Batch:
        """Adds log_probs [B, R] at the batch's sampling temperature (values [B, R] for a critic)."""
        with self.ops.engine.eval_mode():
            return batch.with_tensors(
                self.ops.forward(batch.tensors, temperature=temperature_of(batch), adapter=adapter)
            )

    @register(Dispatch.ONE_TO_ALL, reduce=Reduce.RANK_ZERO)
    def save_state(
        self, path: str, step: int = 0, adapter: str | None = None, optimizer: bool = True
    ) -> None:
        """The engine's weights, optimizer, schedule and RNG under `path` (atomically); an adapter's
        without its optimizer state when `optimizer` is false."""
        self.ops.save_state(path, step, adapter, optimizer)

    @register(Dispatch.ONE_TO_ALL, reduce=Reduce.RANK_ZERO)
    def load_state(self, path: str, optimizer: bool = True, adapter: str | None = None) -> int:
        """Restore what save_state wrote (optimizer=False: the weights only); returns its step."""
        return self.ops.load_state(path, optimizer, adapter)

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
