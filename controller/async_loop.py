"""Asynchronous RL (trainer.mode 'async'): `Trainer.step` with its sync point moved.

Lanes (controller/rollout_lanes.py) fill a bounded rollout buffer while the trainer updates; weights go
back at the next safe point (controller/weight_publisher.py). Step s trains at version s - 1 on samples
of staleness <= trainer.max_staleness; k = 0 computes what sync computes (draw i: the loader's i-th
prompts, sync step i's seed, admitted once version i - 1 is on the workers). A checkpoint records the
oldest draw not trained and the later ones trained, so a resumed job trains no draw twice.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from controller.batch_source import BatchSource, Scored, buffer_metrics, staleness_metrics
from controller.rollout_buffer import BufferTimeout, RolloutBuffer
from controller.rollout_lanes import WAIT_TIMEOUT_S, RolloutProducer
from controller.weight_publisher import RolloutTurn, WeightPublisher
from schema.async_rl import batch_samples, buffer_capacity, staleness_bound

if TYPE_CHECKING:
    from controller.trainer import Trainer

POLL_S = 0.05  # the trainer's wait for a batch checks this often whether a pending sync can go


class LaneSource(BatchSource):
    """The rollout buffer the lanes fill (they start with the first step's wait, after a validation at
    step 0); its `publisher` sends at the next safe point and widens the buffer's admission."""

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
        version, start, synced = t.step_index - 1, time.perf_counter(), {}
        with t.timed("wait_rollout"):
            while True:  # a pending sync goes out as soon as the rollout workers are free
                synced = self.publisher.send_pending() or synced
                try:
                    items, dropped = producer.buffer.take(
                        version, producer.buffer.batch_size, POLL_S, f"trainer of job {t.name}"
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
        """The lanes stop; the next attempt's start from its checkpoint (nothing left to send)."""
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
        """The weights of `version` are on the rollout workers: admission widens to k past it."""
        self._ensure_producer().buffer.set_version(version)

    def state_dict(self, loader: dict[str, Any]) -> dict[str, Any]:
        if self.producer is not None:
            index, loader, trained = self.producer.resume_point()
        else:
            index = self.next_index or self.trainer.step_index + 1
            trained = sorted(self.skip)
        return {"loader": loader, "draw_index": index, "trained_draws": trained}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.next_index = int(state.get("draw_index", self.trainer.step_index + 1))
        self.skip = set(state.get("trained_draws", []))
