"""Typed surfaces of the job's worker groups: what the trainer may call on each role, and what it gets.

A `RayWorkerGroup` binds a worker's registered methods at run time, so type checkers cannot see
them; each class here is the role's contract written out, method by method, with its argument and
result types. The class checks at construction that its worker really registers every method it
forwards, so a renamed worker method fails when the group starts, not in the middle of a job.

Results across ranks are reduced here, explicitly:
- MESH calls that return a Batch come back already gathered by dp rank (controller/dispatch.py);
- update calls return one metrics dict per collected rank; the engine has summed them over
  micro-batches and dp ranks (the loss contract of engines/base.py), so every rank holds the same
  global values and `global_metrics` takes rank 0's;
- a weight sync is timed by each rank on its own; `rank_zero` reports rank 0's measurement.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

from controller.worker_group import RayWorkerGroup
from workers.base import registered_methods
from workers.batch import Batch
from workers.config import UpdateSchedule
from workers.loss_config import PolicyLossConfig


def global_metrics(per_rank: list[dict[str, float]]) -> dict[str, float]:
    """Metrics the engine already all-reduced: identical on every rank, so rank 0's are the global ones."""
    return per_rank[0]


def rank_zero(per_rank: list[Any]) -> Any:
    """Rank 0's own result (a per-rank measurement, e.g. how long its weight sync took)."""
    return per_rank[0]


class RoleGroup:
    """A typed view of one role's RayWorkerGroup; subclasses list the methods they forward."""

    methods: ClassVar[tuple[str, ...]] = ()

    def __init__(self, group: RayWorkerGroup) -> None:
        missing = set(self.methods) - set(registered_methods(group.worker_cls))
        if missing:
            raise TypeError(f"{group.worker_cls.__name__} does not register {sorted(missing)}")
        self.group = group

    def _call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return getattr(self.group, method)(*args, **kwargs)

    def shutdown(self) -> None:
        self.group.shutdown()


class CheckpointedGroup(RoleGroup):
    """A training role: its engine state is checkpointed and its learning rate can change."""

    methods = ("save_checkpoint", "load_checkpoint", "set_hyperparameters")

    def save_checkpoint(self, folder: str, step: int) -> None:
        self._call("save_checkpoint", folder, step)

    def load_checkpoint(self, folder: str) -> int:
        """Restore every rank; returns the checkpoint's step."""
        return rank_zero(self._call("load_checkpoint", folder))

    def set_learning_rate(self, lr: float) -> None:
        self._call("set_hyperparameters", lr=lr)


class ActorGroup(CheckpointedGroup):
    """The hybrid actor-rollout-ref worker (workers/hybrid.py)."""

    methods = CheckpointedGroup.methods + (
        "generate_sequences",
        "compute_log_prob",
        "compute_ref_log_prob",
        "update_actor",
        "update_sft",
        "sync_weights",
        "export_hf",
    )

    def generate_sequences(self, prompts: Batch) -> Batch:
        """One response per row, sampled with the batch's SamplingParams (rollout mesh)."""
        return self._call("generate_sequences", prompts)

    def compute_log_prob(self, batch: Batch) -> Batch:
        """Adds old_log_probs and entropy."""
        return self._call("compute_log_prob", batch)

    def compute_ref_log_prob(self, batch: Batch) -> Batch:
        """Adds ref_log_probs."""
        return self._call("compute_ref_log_prob", batch)

    def update_actor(
        self, batch: Batch, loss: PolicyLossConfig, schedule: UpdateSchedule
    ) -> dict[str, float]:
        return global_metrics(self._call("update_actor", batch, loss, schedule))

    def update_sft(self, batch: Batch, agg_mode: str, schedule: UpdateSchedule) -> dict[str, float]:
        return global_metrics(self._call("update_sft", batch, agg_mode, schedule))

    def sync_weights(self) -> dict[str, float]:
        """Trainer -> rollout engine on every rank; rank 0's weight_sync/* measurements."""
        return rank_zero(self._call("sync_weights"))

    def start_sync_weights(self) -> Callable[[], dict[str, float]]:
        """`sync_weights` started without waiting; call the result to wait for its measurements."""
        pending = self.group.submit("sync_weights")
        return lambda: rank_zero(pending.result())

    def export_hf(self, folder: str, merged: bool = False) -> None:
        """The final policy: an HF folder, or with LoRA a PEFT adapter folder (+ `merged/`)."""
        self._call("export_hf", folder, merged)


class CriticGroup(CheckpointedGroup):
    """The value model (workers/critic.py)."""

    methods = CheckpointedGroup.methods + ("compute_values", "update_critic")

    def compute_values(self, batch: Batch) -> Batch:
        """Adds values [B, R]."""
        return self._call("compute_values", batch)

    def update_critic(
        self, batch: Batch, vf_clip: float | None, agg_mode: str, schedule: UpdateSchedule
    ) -> dict[str, float]:
        return global_metrics(self._call("update_critic", batch, vf_clip, agg_mode, schedule))


class RewardGroup(RoleGroup):
    """The reward model (workers/reward_model.py)."""

    methods = ("compute_rm_score",)

    def compute_rm_score(self, batch: Batch) -> Batch:
        """Adds rm_scores [B] (and rm_token_scores [B, R])."""
        return self._call("compute_rm_score", batch)
