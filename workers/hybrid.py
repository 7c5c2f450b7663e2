"""The hybrid actor-rollout-ref worker: the training role and the rollout role in one process
(placement 'colocated'), the weights moving between them in process (engines/transfer/in_process.py)."""

from __future__ import annotations

from collections.abc import Iterator

from engines.threads import limit_threads_for_model
from engines.transfer.base import NamedTensor
from schema.workers import HybridWorkerConfig
from workers.actor_role import ActorRefWorker
from workers.base import Worker
from workers.rollout_role import RolloutWorker
from workers.transfer_choice import in_process


class ActorRolloutRefWorker(ActorRefWorker, RolloutWorker):
    def __init__(self, config: HybridWorkerConfig | dict) -> None:
        Worker.__init__(self)  # the two roles' build steps, in one process, in this order
        self.config = HybridWorkerConfig.model_validate(config)
        rc = self.config.rollout
        if self.world_size % rc.tensor_parallel_size:
            raise ValueError(
                f"world size {self.world_size} is not a multiple of rollout tensor_parallel_size "
                f"{rc.tensor_parallel_size}"
            )
        self.build_training()
        lora = self.config.actor.lora
        self.build_rollout(
            rc,
            self.config.actor.model_path,
            device=str(self.actor.device),
            lora_rank=lora.rank if lora is not None else None,
        )
        self.weight_sync = in_process(self.rollout, rc.bucket_mb, self.actor)
        limit_threads_for_model(self.config.actor.model_path)
        self.register_actor_mesh()
        self.register_rollout_mesh()
        self.settle_rollout_memory()

    def _before_rollout(self) -> None:
        if self.rollout_config.offload_trainer_during_rollout:
            self.actor.to("cpu")
        super()._before_rollout()

    def _after_rollout(self) -> None:
        super()._after_rollout()
        if self.rollout_config.offload_trainer_during_rollout:
            self.actor.to(str(self.actor.device))

    def _send_weights(self, stream: Iterator[NamedTensor]) -> dict[str, float]:
        """Into this process's rollout engine, resumed for the copy and released after it."""
        if self.rollout.is_released:
            self.rollout.resume_memory()
        metrics = super()._send_weights(stream)
        self.settle_rollout_memory()
        return metrics
