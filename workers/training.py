"""One role's update on a batch: mini-batches and epochs over the engine interface.

The global mini-batch size is split evenly across dp ranks; each epoch visits this rank's rows in a
seeded random order (or in order). Every mini-batch is one `forward_backward` and one `optim_step`;
the learning-rate schedule advances once per call (once per RL step).
"""

from __future__ import annotations

import torch

from engines.training.base import MAX_SUFFIX, TrainEngine, combine_metric
from schema.losses import LossSpec
from schema.workers import UpdateSchedule
from workers.batch import Batch
from workers.operations import TrainOps, prepare_loss


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
