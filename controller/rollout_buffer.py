"""The bounded buffer between the rollout producers and the trainer of an async job, and its admission.

A producer (the rollout loop of controller/async_loop.py, or the agents' endpoint, controller/external.py)
uses two calls:

    wait = buffer.try_admit(samples)   # None: admitted, `samples` now count as running;
                                       # else "full, retry after `wait` seconds" (nothing reserved)
    buffer.put(item)                   # the admitted samples, scored; or buffer.cancel(samples)

`admit(samples, timeout_s, who)` is the blocking form. What a step trains from an item: `payload`
= (Batch in the training layout of workers/rollout_layout.py with a `policy_version` row tensor, the
scores tensor, a metrics dict); one item is one step's batch (`samples` = prompts_per_step x n), and
`version` is the oldest token's weight version (the staleness filter reads it). The trainer calls
`take(version, B)` for a step's worth of items young enough to train at trainer version `version`
(the agents' endpoint's items are groups, several a step).

Admission (AReaL's rule, Fu et al. 2025, "AReaL: A Large-Scale Asynchronous Reinforcement Learning
System", §5; SkyRL's is the same): with k = max_staleness, B = samples of one step and v the
version of the weights the producers hold, a new rollout of n samples starts only while

    accepted + running + n <= (k + v + 1) * B      and      buffered + running + n <= capacity

where `accepted` counts every sample put and not dropped (trained ones included), so generation
waits instead of producing samples that would be too old to train. Filtering stays as the second
guard: `take` drops an item with s - v_item > k (`too_stale`, the job's one staleness filter;
`dropped`), and a dropped item's samples leave `accepted`, so the producers may
replace them.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

RETRY_AFTER_S = 0.05  # the hint of a refused admission: a put or a take changes the answer


def too_stale(trainer_version: int, sample_version: int, max_staleness: int) -> bool:
    """The staleness filter: a sample of weight version v is trained at trainer version s only if
    s - v <= k (trainer.max_staleness)."""
    return trainer_version - sample_version > max_staleness


@dataclass
class BufferedRollout:
    """One admitted unit of generation: `samples` rows, scored, with the weight version of its oldest token."""

    index: int  # the producer's draw counter (its data position and sampling seed)
    samples: int
    version: int
    payload: Any = None  # (batch, scores, metrics) for the trainer
    tokens: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


class BufferTimeout(TimeoutError):
    """A wait on the buffer ran past its timeout; the message names the waiting role."""


class RolloutBuffer:
    """Thread-safe; see the module docstring."""

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

    # ---- the producers' side ---------------------------------------------------------------------

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
        """The producers now hold the weights of `version` (after a sync): admission widens."""
        with self._cond:
            self.version = version
            self._cond.notify_all()

    # ---- the trainer's side ----------------------------------------------------------------------

    def take(
        self, version: int, samples: int, timeout_s: float, who: str
    ) -> tuple[list[BufferedRollout], int]:
        """The oldest items trainable at trainer version `version` that hold at least `samples` (a
        step's worth: one draw of the lanes, or groups of the agents), and the samples dropped as too
        old on the way. Raises the producers' error, or BufferTimeout naming `who` (nothing taken)."""
        deadline, dropped = time.monotonic() + timeout_s, 0
        with self._cond:
            while True:
                dropped += self._drop_stale(version)
                if sum(item.samples for item in self._items) >= samples:
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
        """Buffered items for which `predicate(item)` holds, dropped and counted as `take` counts too
        old ones; returns their samples."""
        with self._cond:
            samples = sum(item.samples for item in self._items if predicate(item))
            self._items = [item for item in self._items if not predicate(item)]
            self._count_dropped(samples)
            return samples

    def _drop_stale(self, version: int) -> int:
        """The filter, applied to the oldest items (FIFO: the oldest versions); returns the samples
        dropped. The lock is held."""
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

    # ---- state -----------------------------------------------------------------------------------

    def buffered_samples(self) -> int:
        with self._cond:
            return sum(item.samples for item in self._items)

    def pending_indices(self) -> list[int]:
        """Draw indices generated and not yet trained (buffered), in order."""
        with self._cond:
            return [item.index for item in self._items]

    def _room(self, samples: int) -> bool:
        staleness_bound = (self.max_staleness + self.version + 1) * self.batch_size
        buffered = sum(item.samples for item in self._items)
        return (
            self.accepted + self.running + samples <= staleness_bound
            and buffered + self.running + samples <= self.capacity
        )
