"""The bounded buffer between an async job's rollout producers (lanes, or the agents' endpoint) and
its trainer, with AReaL's admission: with k = max_staleness, B = samples of one step and v the
producers' weight version, n more samples start only while

    accepted + running + n <= (k + v + 1) * B      and      buffered + running + n <= capacity

(`accepted`: every sample put and not dropped), so generation waits instead of producing samples too
old to train. `take` still drops items with s - v_item > k (`too_stale`, the job's one filter).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

RETRY_AFTER_S = 0.05  # the hint of a refused admission: a put or a take changes the answer


def too_stale(trainer_version: int, sample_version: int, max_staleness: int) -> bool:
    return trainer_version - sample_version > max_staleness


@dataclass
class BufferedRollout:
    """One admitted unit of generation, scored; `version` is its oldest token's."""

    index: int  # the producer's draw counter (its data position and sampling seed)
    samples: int
    version: int
    payload: Any = None  # (batch, scores, metrics) for the trainer
    tokens: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


class BufferTimeout(TimeoutError):
    """A wait on the buffer ran past its timeout; the message names the waiter."""


class RolloutBuffer:
    def __init__(self, batch_size: int, max_staleness: int, capacity: int, version: int = 0) -> None:
        if capacity < batch_size:
            raise ValueError(f"buffer capacity {capacity} is smaller than a batch of {batch_size}")
        self.batch_size, self.max_staleness, self.capacity = batch_size, max_staleness, capacity
        self._cond = threading.Condition()
        self._items: list[BufferedRollout] = []
        self.version = version  # the producers' weight version
        self.accepted = version * batch_size  # a resumed job has trained `version` batches
        self.running = 0
        self.dropped = 0  # samples dropped as too old, since the start
        self.closed: BaseException | None = None

    def try_admit(self, samples: int) -> float | None:
        """None when `samples` more may start (they count as running), else seconds to retry after."""
        with self._cond:
            if self._room(samples):
                self.running += samples
                return None
            return RETRY_AFTER_S

    def admit(self, samples: int, timeout_s: float, who: str, stop: threading.Event | None = None) -> bool:
        """Wait until `samples` may start; False when `stop` was set. Raises BufferTimeout naming `who`."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while not self._room(samples):
                if stop is not None and stop.is_set():
                    return False
                left = deadline - time.monotonic()
                if left <= 0:
                    raise BufferTimeout(f"{who}: no room in the rollout buffer within {timeout_s:.0f} s")
                self._cond.wait(min(left, 0.5))
            self.running += samples
            return True

    def put(self, item: BufferedRollout) -> None:
        with self._cond:
            self.running -= item.samples
            self.accepted += item.samples
            self._items.append(item)
            self._cond.notify_all()

    def cancel(self, samples: int) -> None:
        """Admitted samples that will not come (a failed or stopped generation)."""
        with self._cond:
            self.running -= samples
            self._cond.notify_all()

    def fail(self, err: BaseException) -> None:
        """A producer failed: the trainer's next `take` raises it."""
        with self._cond:
            self.closed = err
            self._cond.notify_all()

    def set_version(self, version: int) -> None:
        with self._cond:
            self.version = version
            self._cond.notify_all()

    def take(
        self, version: int, samples: int, timeout_s: float, who: str
    ) -> tuple[list[BufferedRollout], int]:
        """The oldest items trainable at `version` holding at least `samples`, and the samples dropped
        as too old; raises the producers' error, or BufferTimeout (nothing taken)."""
        deadline, dropped = time.monotonic() + timeout_s, 0
        with self._cond:
            while True:
                dropped += self._drop_stale(version)
                if self.buffered_samples() >= samples:
                    taken: list[BufferedRollout] = []
                    while sum(item.samples for item in taken) < samples:
                        taken.append(self._items.pop(0))
                    self._cond.notify_all()
                    return taken, dropped
                if self.closed is not None:
                    raise self.closed
                left = deadline - time.monotonic()
                if left <= 0:
                    raise BufferTimeout(f"{who}: no rollout ready within {timeout_s:.0f} s")
                self._cond.wait(min(left, 0.5))

    def drop_where(self, predicate: Any) -> int:
        """Drops (and counts) the buffered items `predicate` holds for; returns their samples."""
        with self._cond:
            samples = sum(item.samples for item in self._items if predicate(item))
            self._items = [item for item in self._items if not predicate(item)]
            self._count_dropped(samples)
            return samples

    def _drop_stale(self, version: int) -> int:
        """The filter on the oldest items (FIFO); the lock is held."""
        gone = 0
        while self._items and too_stale(version, self._items[0].version, self.max_staleness):
            gone += self._items.pop(0).samples
        self._count_dropped(gone)
        return gone

    def _count_dropped(self, samples: int) -> None:
        self.accepted -= samples
        self.dropped += samples
        if samples:
            self._cond.notify_all()

    def buffered_samples(self) -> int:
        with self._cond:
            return sum(item.samples for item in self._items)

    def pending_indices(self) -> list[int]:
        with self._cond:
            return [item.index for item in self._items]

    def _room(self, samples: int) -> bool:
        staleness_bound = (self.max_staleness + self.version + 1) * self.batch_size
        return (
            self.accepted + self.running + samples <= staleness_bound
            and self.buffered_samples() + self.running + samples <= self.capacity
        )
