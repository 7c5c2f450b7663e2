"""trainer.mode async with rollout.source external: agents' trajectories through the rollout buffer.

The job's `RolloutBuffer` (controller/rollout_buffer.py) lives in the endpoint's actor
(controller/external.py), beside the calls it admits, with B = trajectories_per_step and one sample
per trajectory:

    first call of a trajectory     store.open -> buffer.try_admit(1); refused: a 429 with Retry-After
    no reward in time, failed call buffer.cancel(1) (the store does both)
    a reward completes a group     put_groups: one item, version = the group's oldest call's version;
                                   each row's `policy_version` = its trajectory's oldest call's version
    the trainer's step s           take_step(s - 1): groups oldest first until a step's worth
                                   (`take`: the buffer's one staleness filter dropping, and counting,
                                   those older than k; nothing taken while short of it)
    the trainer's sync             buffer.set_version: admission widens
    a restart of the workers       rewind(checkpoint's step): what the lost attempt's newer weights
                                   sampled is dropped and counted; admission from that step on

Plain Python: no torch, no Ray.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from controller.external_store import Trajectory, TrajectoryStore
from controller.rollout_buffer import BufferedRollout, BufferTimeout, RolloutBuffer


class ExternalBuffer:
    """See the module docstring. `rows(t)` lays a trajectory out as the trainer's rows (one per segment)."""

    def __init__(self, store: TrajectoryStore, rows: Callable[[Trajectory], list[dict[str, Any]]],
                 max_staleness: int, capacity: int, version: int) -> None:  # fmt: skip
        self.store, self.rows = store, rows
        self.buffer = RolloutBuffer(store.config.trajectories_per_step, max_staleness, capacity, version)
        store.buffer = self.buffer  # the store admits new trajectories through it
        self._groups = 0

    def put_groups(self) -> None:
        """Every group the last reward completed, into the buffer with its versions."""
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
        """The workers restarted from the checkpoint of `version`: groups and trajectories with a call
        sampled by newer weights (the lost attempt's, which no later step will have) are dropped, as
        stale ones are (a later call or reward of such a trajectory: 409 'dropped'), and admission
        starts again from `version`. Returns how many trajectories were dropped."""
        newer = lambda g: g.extra.get("newest", g.version) > version  # noqa: E731
        dropped = self.buffer.drop_where(newer)
        gone = self.store.drop_where(
            lambda t: any(v > version for s in t.segments for v in s.weight_versions)
        )
        self.buffer.cancel(gone)  # admitted, not put yet: their room goes back
        self.buffer.set_version(version)
        return dropped + gone

    def take_step(self, version: int, who: str) -> dict[str, Any] | None:
        """A step's rows trainable at trainer version `version`, or None while the buffer holds fewer."""
        try:
            groups, _ = self.buffer.take(version, self.buffer.batch_size, 0.0, who)
        except BufferTimeout:
            return None
        return {
            "rows": [row for g in groups for row in g.payload],
            "dropped_total": self.buffer.dropped,
            "fill": self.buffer.buffered_samples() / self.buffer.capacity,
        }
