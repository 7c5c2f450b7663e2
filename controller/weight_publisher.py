"""How a step's weights reach the rollout workers: now, or at the next safe point.

A rollout worker serves one call at a time, so a transfer sent while it generates would wait inside
the transfer. Sync and agent-fed jobs publish now; async lanes share a `RolloutTurn`, and a sync goes
only when no generation call is in flight, which also tells the version of every generation call.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from controller.trainer import Trainer

SYNC_GRACE_S = 0.05  # a step's sync waits this long for the generation calls in flight to end


class RolloutTurn:
    """The rollout workers serve generation calls (one per lane at a time) or a weight sync, never both."""

    def __init__(self, sync_first: bool = False) -> None:
        """`sync_first`: a sync that found calls in flight stops new calls until it went (partial
        rollouts: their calls are short, and the weights should land mid-draw)."""
        self._cond = threading.Condition()
        self._calls = 0
        self._syncing = False
        self._sync_first, self._sync_wanted = sync_first, False
        self._hold_wanted = False  # `hold` is waiting: new generation calls wait behind it

    @contextmanager
    def generation(self, timeout_s: float, who: str) -> Iterator[float]:
        """Yields the seconds waited for a sync to finish."""
        start = time.perf_counter()
        with self._cond:
            free = lambda: not (self._syncing or self._sync_wanted or self._hold_wanted)  # noqa: E731
            if not self._cond.wait_for(free, timeout_s):
                raise TimeoutError(f"{who}: a weight sync did not end within {timeout_s:.0f} s")
            self._calls += 1
        try:
            yield time.perf_counter() - start
        finally:
            with self._cond:
                self._calls -= 1
                self._cond.notify_all()

    def try_sync(self, wait_s: float = 0.0) -> bool:
        """True (the workers are the sync's until `release`) when no call is in flight within `wait_s`."""
        with self._cond:
            if not self._cond.wait_for(lambda: self._calls == 0 and not self._syncing, wait_s):
                self._sync_wanted = self._sync_first
                return False
            self._syncing, self._sync_wanted = True, False
            return True

    def hold(self, timeout_s: float) -> bool:
        """As try_sync, but no new call starts while it waits, so busy lanes cannot starve it (a
        validation gets the workers to itself, as in sync). True once held; `release` ends it."""
        with self._cond:
            self._hold_wanted = True
            try:
                if not self._cond.wait_for(lambda: self._calls == 0 and not self._syncing, timeout_s):
                    return False
                self._syncing = True
                return True
            finally:
                self._hold_wanted = False
                self._cond.notify_all()

    def release(self) -> None:
        with self._cond:
            self._syncing = False
            self._cond.notify_all()


class WeightPublisher:
    """`publish()` starts the step's sync and returns what to call to wait for it; with a `turn`, a
    sync that finds calls in flight is pending until `send_pending` or `exclusive` finds the workers
    free. `sent(version)` hears when the weights of trainer version `version` are on the workers."""

    def __init__(
        self, trainer: Trainer, turn: RolloutTurn | None = None, sent: Callable[[int], None] | None = None
    ) -> None:
        self.trainer, self.turn, self.sent = trainer, turn, sent
        self.pending = False  # the rollout workers hold older weights than the trainer
        self.version = trainer.step_index  # the trainer's weights: the updates done when last published

    def publish(self) -> Callable[[], dict[str, float]]:
        self.version = self.trainer.step_index
        if self.turn is None:
            return self._send(release=False)
        self.pending = True
        if not self.turn.try_sync(SYNC_GRACE_S):
            return dict
        return self._send(release=True)

    def send_pending(self) -> dict[str, float]:
        """A pending sync, sent and waited for if the rollout workers are free now; else {}."""
        if self.pending and self.turn.try_sync():
            return self._send(release=True)()
        return {}

    @contextmanager
    def exclusive(self, timeout_s: float) -> Iterator[None]:
        """The rollout workers to the caller alone, with the trainer's newest weights."""
        if self.turn is None:
            yield
            return
        if not self.turn.hold(timeout_s):
            raise TimeoutError(f"rollout workers of job {self.trainer.name}: busy for {timeout_s:.0f} s")
        try:
            if self.pending:
                self._send(release=False)()
            yield
        finally:
            self.turn.release()

    def _send(self, release: bool) -> Callable[[], dict[str, float]]:
        """Start the transfer; the result waits for it, then tells `sent` (`release`: give the turn
        back after). The version is the one published: a pending sync sent during the next step's
        wait carries the weights of the step before."""
        version = self.version
        try:
            done = self.trainer.job.groups.actor.start_sync_weights()
        except BaseException:
            if release:
                self.turn.release()
            raise

        def wait() -> dict[str, float]:
            try:
                out = done()
                self.pending = False
                if self.sent is not None:
                    self.sent(version)
                return out
            finally:
                if release:
                    self.turn.release()

        return wait
