"""The rollout workers as a sending training rank sees them, over Ray: a method started on all of
them, then waited for with a timeout; a receiver that died or hung fails the transfer with a
`TransferError` naming the rollout group and rank."""

from __future__ import annotations

from typing import Any

import ray

from engines.transfer.base import TransferError
from workers.remote import WorkerGroupError, wait_all


class RolloutPeers:
    """The `Receivers` of engines/transfer/base.py over the rollout group's Ray actors."""

    def __init__(self, actors: list[Any], group: str, timeout_s: float) -> None:
        self.actors, self.group, self.timeout_s = list(actors), group, timeout_s
        self._method = ""
        self._refs: list[ray.ObjectRef] = []

    def __len__(self) -> int:
        return len(self.actors)

    def start(self, method: str, *args: Any) -> None:
        self._method = method
        self._refs = [actor.execute.remote(method, (args, {})) for actor in self.actors]

    def start_each(self, method: str, per_rank: list[tuple]) -> None:
        self._method = method
        self._refs = [
            actor.execute.remote(method, (args, {}))
            for actor, args in zip(self.actors, per_rank, strict=True)
        ]

    def wait(self, timeout_s: float | None = None) -> list[Any]:
        refs, self._refs = self._refs, []
        try:
            return wait_all(self.group, self._method, refs, timeout_s or self.timeout_s)
        except WorkerGroupError as err:
            raise TransferError(f"weight transfer failed: {err}") from err
