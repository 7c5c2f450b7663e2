"""The lanes of an async job: controller threads that keep the rollout workers generating into the
rollout buffer ahead of the trainer (controller/async_loop.py takes from it), whole draws or in
segments (trainer.partial_rollouts, controller/partial_rollout.py), scored by `JobSetup.scored`.
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING, Any

import torch

from controller.partial_rollout import generate_in_segments
from controller.rollout_buffer import BufferedRollout, RolloutBuffer
from controller.rollout_turn import RolloutTurn
from controller.worker_group import DEFAULT_ROLE
from engines.rollout.hf import read_special_token_ids
from schema.async_rl import resolved_lanes
from workers.remote import wait_all

if TYPE_CHECKING:
    from controller.trainer import Trainer

WAIT_TIMEOUT_S = 3600.0  # a generation call's own timeout bounds the lanes; this bounds their waits


class RolloutProducer:
    """Controller threads ("lanes") that keep the rollout workers generating into the buffer: one lane
    for the whole group (a draw split over its workers, as sync does), or one per rollout worker
    (trainer.rollout_lanes), each sending whole draws to its worker, so that several draws' slow
    environment steps overlap."""

    def __init__(
        self, trainer: Trainer, turn: RolloutTurn, buffer: RolloutBuffer, next_index: int, skip: set[int]
    ) -> None:
        self.trainer, self.turn, self.buffer, self.next_index = trainer, turn, buffer, next_index
        self.skip = skip  # draws trained before the checkpoint that resumed this run
        self.version = buffer.version  # the weights on the rollout workers (set after each sync)
        self.stop = threading.Event()
        self.lock = threading.Lock()  # guards the draw state below against state_dict
        self.in_flight: set[int] = set()
        self.trained_draws: set[int] = set()
        self.loader_states: dict[int, dict[str, Any]] = {}  # the loader before each unsettled draw
        self.stats = {"wait_s": 0.0, "busy_s": 0.0, "tokens": 0.0}
        self.pad = read_special_token_ids(trainer.job.model_path)[1]  # the rollout engine's padding
        group = trainer.job.groups.actor.rollout.group
        lanes = group.actors if resolved_lanes(trainer.spec) == "per_worker" else [None]
        self.threads = [
            threading.Thread(
                target=self._run, args=(actor, i), name=f"rollout-lane-{i}-{trainer.name}", daemon=True
            )
            for i, actor in enumerate(lanes)
        ]

    def start(self) -> None:
        for thread in self.threads:
            thread.start()

    def close(self, timeout_s: float = 30.0) -> None:
        self.stop.set()
        for thread in self.threads:  # a call in flight ends with its workers (the group shuts down next)
            thread.join(timeout_s)

    def take_stats(self) -> dict[str, float]:
        with self.lock:
            stats, self.stats = self.stats, {"wait_s": 0.0, "busy_s": 0.0, "tokens": 0.0}
        return stats

    def _run(self, actor: Any, lane: int) -> None:
        samples = self.buffer.batch_size
        who = f"rollout workers of job {self.trainer.name}" + ("" if actor is None else f", rank {lane}")
        try:
            while not self.stop.is_set():
                start = time.perf_counter()
                if not self.buffer.admit(samples, WAIT_TIMEOUT_S, who, self.stop):
                    return
                waited = time.perf_counter() - start
                try:
                    item = self._produce(actor, who)
                except BaseException:
                    self.buffer.cancel(samples)
                    raise
                with self.lock:
                    self.stats["wait_s"] += waited
                if item is None:
                    self.buffer.cancel(samples)
                    return
                self.buffer.put(item)
                with self.lock:
                    self.in_flight.discard(item.index)
        except BaseException as err:  # noqa: BLE001 -- handed to the trainer, which raises it
            self.buffer.fail(err)

    def _draw(self) -> tuple[int, Any]:
        """The next draw not trained yet: its index and prompts (the loader's i-th, sync step i's seed)."""
        job = self.trainer.job
        with self.lock:
            while True:
                index = self.next_index
                self.loader_states[index] = job.loader.state_dict()
                prompts = job.next_prompts(index)
                self.next_index += 1
                if index not in self.skip:
                    self.in_flight.add(index)
                    return index, prompts
                self.skip.discard(index)
                del self.loader_states[index]

    def _produce(self, actor: Any, who: str) -> BufferedRollout | None:
        spec = self.trainer.spec
        index, prompts = self._draw()
        if self.stop.is_set():
            return None
        if spec.trainer.partial_rollouts:
            start = time.perf_counter()
            batch, busy = generate_in_segments(
                prompts,
                spec.trainer.segment_tokens,
                lambda rows, params: self._low_level(actor, rows, params, who),
                lambda: self.turn.generation(WAIT_TIMEOUT_S, who),
                lambda: self.version,
                self.pad,
            )
            waited, version = time.perf_counter() - start - busy, int(batch.tensors["policy_version"].min())
        else:
            with self.turn.generation(WAIT_TIMEOUT_S, who) as waited:
                version, start = self.version, time.perf_counter()
                batch = self._generate(actor, prompts, who)
                busy = time.perf_counter() - start
            batch.tensors["policy_version"] = torch.full((len(batch),), version, dtype=torch.long)
        batch, scores, metrics = self.trainer.job.scored(batch)
        tokens = float(batch.tensors["response_mask"].sum())
        with self.lock:
            self.stats["wait_s"] += waited
            self.stats["busy_s"] += busy
            self.stats["tokens"] += tokens
        payload = (batch, scores, metrics)
        return BufferedRollout(index, len(batch), version, payload, int(tokens))

    def _generate(self, actor: Any, prompts: Any, who: str) -> Any:
        actors = self.trainer.job.groups.actor
        if actor is None:
            return actors.generate_sequences(prompts)
        group = actors.rollout.group
        ref = actor.execute.remote(DEFAULT_ROLE, "generate_sequences", ((prompts,), {}))
        return wait_all(who, "generate_sequences", [ref], group.call_timeout_s)[0]

    def _low_level(self, actor: Any, rows: list[list[int]], params: Any, who: str) -> list:
        """One `generate` call (completions, no layout): on the group's rank 0, or on the lane's worker."""
        if actor is None:
            return self.trainer.job.groups.actor.rollout.generate(rows, params)
        group = self.trainer.job.groups.actor.rollout.group
        ref = actor.execute.remote(DEFAULT_ROLE, "generate", ((rows, params), {}))
        return wait_all(who, "generate", [ref], group.call_timeout_s)[0]

    def resume_point(self) -> tuple[int, dict[str, Any], list[int]]:
        """(index, loader state before it) of the oldest draw not trained, and the later ones trained."""
        with self.lock:
            first = min([*self.buffer.pending_indices(), *self.in_flight, self.next_index])
            loader = self.loader_states.get(first) or self.trainer.job.loader.state_dict()
            return first, loader, sorted(i for i in self.trained_draws if i > first)

    def trained(self, index: int) -> None:
        with self.lock:
            self.trained_draws.add(index)
            first = min([*self.buffer.pending_indices(), *self.in_flight, self.next_index])
            self.trained_draws = {i for i in self.trained_draws if i > first}
            for old in [i for i in self.loader_states if i < first]:
                del self.loader_states[old]
