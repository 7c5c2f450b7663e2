"""Asynchronous RL (trainer.mode 'async'): `Trainer.step` with its sync point moved.

The step is the sync one (controller/trainer.py). Its samples come from `LaneSource`: a bounded
rollout buffer (controller/rollout_buffer.py) that lanes (controller/rollout_lanes.py) fill from
the rollout workers while the training ranks update; its weights go back at the next safe point,
between the rollout workers' generation calls (controller/weight_publisher.py).

    lanes (RolloutProducer threads)                   trainer thread (Trainer.step)
    admit B samples (AReaL's rule, the buffer)        take the oldest batch young enough
    draw prompts i (seed of i), generate on the       (older ones dropped: async/dropped_stale)
      rollout workers, score, put                     log-probs, advantages, update_actor
    ... next i while the trainer updates ...          publish: now if no generation call is in
                                                      flight, else when the workers are free

Versions count optimizer steps: step s trains at version s - 1; a sample of version v has staleness
s - 1 - v <= trainer.max_staleness. k = 0 computes what sync computes: the buffer admits draw i only
once the weights of version i - 1 are on the rollout workers, and draw i takes the loader's i-th
prompts and sync step i's seed. A checkpoint records the loader before the oldest draw not trained
(buffered or in flight) and the later draws trained; a resumed job regenerates the others with the
checkpoint's weights, so no draw is trained twice. The off-policy correction is controller/off_policy.py's.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from controller.batch_source import BatchSource, Scored, buffer_metrics, staleness_metrics
from controller.off_policy import corrected_spec  # noqa: F401 (re-exported: the async loss settings)
from controller.rollout_buffer import BufferTimeout, RolloutBuffer
from controller.rollout_lanes import WAIT_TIMEOUT_S, RolloutProducer
from controller.rollout_turn import RolloutTurn
from controller.sink import JobSink
from controller.weight_publisher import WeightPublisher
from schema.async_rl import batch_samples, buffer_capacity, staleness_bound
from schema.job import JobSpec

if TYPE_CHECKING:
    from controller.trainer import Trainer

POLL_S = 0.05  # the trainer's wait for a batch checks this often whether a pending sync can go


def make_trainer(
    spec: JobSpec, workdir: str | Path, sink: JobSink, name: str = "job", restarts: int = 0
) -> Trainer:
    """The job's trainer (one for every mode: the source and the publisher differ)."""
    from controller.trainer import Trainer

    return Trainer(spec, workdir, sink, name=name, restarts=restarts)


class LaneSource(BatchSource):
    """An async job's batch source: the rollout buffer the lanes fill (see the module docstring; the
    lanes start with the first step's wait, after a validation at step 0). Its `publisher` sends the
    weights at the next safe point and widens the buffer's admission."""

    def __init__(self, trainer: Trainer) -> None:
        self.trainer = trainer
        self.turn = RolloutTurn(sync_first=trainer.spec.trainer.partial_rollouts)
        self.publisher = WeightPublisher(trainer, self.turn, sent=self._sent)
        self.max_staleness = staleness_bound(trainer.spec)
        self.producer: RolloutProducer | None = None
        self.next_index: int | None = None  # from a checkpoint: the first draw not trained
        self.skip: set[int] = set()  # from a checkpoint: later draws already trained
        self.dropped_total = 0

    def next_batch(self) -> Scored:
        t, producer = self.trainer, self._ensure_producer()
        version, samples, start, synced = (
            t.step_index - 1,
            producer.buffer.batch_size,
            time.perf_counter(),
            {},
        )
        with t.timed("wait_rollout"):
            while True:  # a pending sync goes out as soon as the rollout workers are free
                synced = self.publisher.send_pending() or synced
                try:
                    items, dropped = producer.buffer.take(
                        version, samples, POLL_S, f"trainer of job {t.name}"
                    )
                    break
                except BufferTimeout:
                    if time.perf_counter() - start > WAIT_TIMEOUT_S:
                        raise
        waited = time.perf_counter() - start
        item = items[0]  # one draw: a step's samples
        producer.trained(item.index)
        batch, scores, metrics = item.payload
        self.dropped_total += dropped
        stats = producer.take_stats()
        fill = producer.buffer.buffered_samples() / producer.buffer.capacity
        metrics = {**metrics, **synced, **buffer_metrics(fill, dropped, self.dropped_total, waited)}
        metrics.update(
            {
                "async/draw_index": float(item.index),
                "async/rollout_wait_s": stats["wait_s"],
                "perf/rollout_tokens_per_s": stats["tokens"] / max(stats["busy_s"], 1e-9),
            }
        )
        return batch, scores, staleness_metrics(metrics, batch, version, self.max_staleness)

    def stop(self) -> None:
        """The attempt's workers go: the lanes stop; the next attempt's start from its checkpoint,
        whose weights its rollout workers load (nothing left to send)."""
        if self.producer is not None:
            self.producer.close()
        self.producer, self.next_index, self.skip = None, None, set()
        self.publisher.pending = False

    def _ensure_producer(self) -> RolloutProducer:
        if self.producer is None:
            spec, samples = self.trainer.spec, batch_samples(self.trainer.spec)
            version = self.trainer.step_index - 1
            capacity = buffer_capacity(spec, samples)
            buffer = RolloutBuffer(samples, self.max_staleness, capacity, version=version)
            next_index = self.next_index if self.next_index is not None else self.trainer.step_index
            self.producer = RolloutProducer(self.trainer, self.turn, buffer, next_index, set(self.skip))
            self.producer.start()
        return self.producer

    def _sent(self, version: int) -> None:
        """The weights of `version` are on the rollout workers: the lanes' calls record it, and the
        buffer admits draws up to k versions past it."""
        producer = self._ensure_producer()
        producer.version = version
        producer.buffer.set_version(version)

    # ---- checkpoints -----------------------------------------------------------------------------

    def state_dict(self, loader: dict[str, Any]) -> dict[str, Any]:
        """The loader before the oldest draw not trained, its index, and the later draws trained."""
        if self.producer is not None:
            index, loader, trained = self.producer.resume_point()
        else:
            index = self.next_index or self.trainer.step_index + 1
            trained = sorted(self.skip)
        return {"loader": loader, "draw_index": index, "trained_draws": trained}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """After the trainer's own: its loader is at the oldest untrained draw."""
        self.next_index = int(state.get("draw_index", self.trainer.step_index + 1))
        self.skip = set(state.get("trained_draws", []))
