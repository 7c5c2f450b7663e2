"""Who uses an async job's rollout workers now: generation calls (one per producer lane) or a weight sync.

A rollout worker serves one call at a time, so a weight transfer sent while it generates would wait
inside the transfer; the controller keeps the two apart instead (controller/async_loop.py), which
also tells it the weight version of every generation call.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager


class RolloutTurn:
    """The rollout workers serve generation calls (one per lane at a time) or a weight sync, never both:
    a sync starts only when no call is in flight, and no call starts during a sync."""

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
        """True (the workers are the sync's until `release`) when no generation call is in flight
        within `wait_s` seconds."""
        with self._cond:
            if not self._cond.wait_for(lambda: self._calls == 0 and not self._syncing, wait_s):
                self._sync_wanted = self._sync_first
                return False
            self._syncing, self._sync_wanted = True, False
            return True

    def hold(self, timeout_s: float) -> bool:
        """As try_sync, but no new generation call starts while it waits, so busy lanes cannot starve
        it: a validation gets the rollout workers to itself (the trainer's newest weights, then its
        generation, as in sync, where nothing else runs meanwhile). True once held; `release` ends it."""
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
