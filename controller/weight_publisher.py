"""How a step's weights reach the rollout workers: now, or at the next safe point.

`publish()` starts the step's sync and returns what to call to wait for it (its measurements).
Now (sync jobs, agent-fed jobs): a rollout worker serves one call at a time, so the weights land
between generation calls. At the next safe point (async lanes, `turn` set): now if no generation
call is in flight (controller/rollout_turn.py), else pending until the workers are free
(`send_pending`, polled while the trainer waits for a batch; `exclusive`, held by a validation), so
the version of every generation call is known. `sent(version)` hears when the weights of trainer
version `version` are on the rollout workers.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

from controller.rollout_turn import RolloutTurn

if TYPE_CHECKING:
    from controller.trainer import Trainer

SYNC_GRACE_S = 0.05  # a step's sync waits this long for the generation calls in flight to end


class WeightPublisher:
    """See the module docstring."""

    def __init__(
        self, trainer: Trainer, turn: RolloutTurn | None = None, sent: Callable[[int], None] | None = None
    ) -> None:
        self.trainer, self.turn, self.sent = trainer, turn, sent
        self.pending = False  # the rollout workers hold older weights than the trainer
        self.version = trainer.step_index  # the trainer's weights: the updates done when last published

    def publish(self) -> Callable[[], dict[str, float]]:
        """The step's sync, started (or left pending until the workers are free); call to wait."""
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
        """The rollout workers to the caller alone, with the trainer's newest weights (a pending sync
        goes first); with no turn to share, nothing to wait for."""
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
        """Start the transfer of the trainer's weights; the result waits for it, then tells `sent`
        (`release`: the turn was taken for this sync alone and is given back after it). The version
        is the one published: a pending sync sent during the next step's wait for its batch carries
        the weights of the step before, not of the step waiting."""
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
