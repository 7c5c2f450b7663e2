"""The in-process strategy: the rollout engine lives in the sender's process (colocated)."""

from __future__ import annotations

from engines.rollout.base import RolloutEngine
from engines.transfer.base import NamedTensor, WeightTransfer


class InProcessTransfer(WeightTransfer):
    def __init__(self, rollout: RolloutEngine, bucket_mb: float = 512) -> None:
        super().__init__(bucket_mb, dtype=rollout.dtype)  # cast to what the engine takes
        self.rollout = rollout

    def send(self, bucket: list[NamedTensor]) -> None:
        self.rollout.update_weights(bucket)

    def finish(self) -> int:
        return self.rollout.finish_update()
