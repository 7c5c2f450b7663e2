"""trainer.mode async with rollout.source external: agents' trajectories through the job's
`RolloutBuffer`, which lives in the endpoint's actor with B = trajectories_per_step and one sample per
trajectory. A trajectory's first call is its admission; a reward that completes a group puts it (its
version: the group's oldest call's); a step takes groups oldest first through the buffer's staleness
filter; a restart of the workers drops what the lost attempt's newer weights sampled.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from controller.external_store import Trajectory, TrajectoryStore
from controller.rollout_buffer import BufferedRollout, BufferTimeout, RolloutBuffer


class ExternalBuffer:
    """`rows(t)` lays a trajectory out as the trainer's rows (one per segment)."""

    def __init__(self, store: TrajectoryStore, rows: Callable[[Trajectory], list[dict[str, Any]]],
                 max_staleness: int, capacity: int, version: int) -> None:  # fmt: skip
        self.store, self.rows = store, rows
        self.buffer = RolloutBuffer(store.config.trajectories_per_step, max_staleness, capacity, version)
        store.buffer = self.buffer  # the store admits new trajectories through it
        self._groups = 0

    def put_groups(self) -> None:
        for group in self.store.take_groups():
            newest = max(v for t in group for s in t.segments for v in s.weight_versions)
            rows = []
            for t in group:
                oldest = min(v for s in t.segments for v in s.weight_versions)
                rows += [{**row, "policy_version": oldest} for row in self.rows(t)]
                t.segments = []  # its tokens are in the buffer now
            version = min(row["policy_version"] for row in rows)
            self.buffer.put(
                BufferedRollout(self._groups, len(group), version, rows, extra={"newest": newest})
            )
            self._groups += 1

    def rewind(self, version: int) -> int:
        """The workers restarted from the checkpoint of `version`: what newer weights sampled is dropped
        (a later call or reward of it: 409), admission restarts from `version`; returns how many."""
        newer = lambda g: g.extra.get("newest", g.version) > version  # noqa: E731
        dropped = self.buffer.drop_where(newer)
        gone = self.store.drop_where(
            lambda t: any(v > version for s in t.segments for v in s.weight_versions)
        )
        self.buffer.cancel(gone)  # admitted, not put yet: their room goes back
        self.buffer.set_version(version)
        return dropped + gone

    def take_step(self, version: int, who: str) -> dict[str, Any] | None:
        try:
            groups, _ = self.buffer.take(version, self.buffer.batch_size, 0.0, who)
        except BufferTimeout:
            return None
        return {
            "rows": [row for g in groups for row in g.payload],
            "dropped_total": self.buffer.dropped,
            "fill": self.buffer.buffered_samples() / self.buffer.capacity,
        }
