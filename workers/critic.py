"""The critic: a value-head FSDP engine that scores every response token and learns the returns.
It registers only the "actor" mesh, so it can share bundles (or processes) with another role."""

from __future__ import annotations

from engines.threads import limit_threads_for_model
from engines.training.registry import build_train_engine
from schema.engine import EngineConfig
from schema.losses import ValueLossConfig
from schema.workers import UpdateSchedule
from workers.base import Dispatch, Reduce, register
from workers.batch import Batch
from workers.operations import TrainingOperations, TrainOps, train_on_batch


class CriticWorker(TrainingOperations):
    """The value model; checkpoints and live edits are the training operations' (workers/operations.py)."""

    checkpoint_name = "critic"

    def __init__(self, config: EngineConfig | dict) -> None:
        super().__init__()
        cfg = EngineConfig.model_validate(config).model_copy(update={"role": "value"})
        self.critic = build_train_engine(cfg)
        self.critic.initialize()
        self.ops = TrainOps(self.critic)
        limit_threads_for_model(cfg.model_path)
        self.register_mesh("actor", dp_rank=self.critic.dp_rank, is_collect=self.critic.is_collect_rank)

    @register(Dispatch.MESH, mesh="actor")
    def compute_values(self, batch: Batch) -> Batch:
        """values [B, R]: the critic's estimate before each response token (a value head's forward)."""
        return self.forward(batch)

    @register(Dispatch.MESH, mesh="actor", reduce=Reduce.GLOBAL)
    def update_critic(
        self, batch: Batch, vf_clip: float | None, agg_mode: str, schedule: UpdateSchedule | dict
    ) -> dict[str, float]:
        loss = ValueLossConfig(vf_clip=vf_clip, loss_agg_mode=agg_mode)
        return train_on_batch(self.critic, batch, loss, schedule, "critic")
