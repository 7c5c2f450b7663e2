"""The lanes of an async job: controller threads that keep the rollout workers generating into the
rollout buffer ahead of the trainer, whole draws or in segments (trainer.partial_rollouts).

With partial rollouts each segment is one generation call, so a weight sync lands between segments;
every token keeps the version that sampled it (`token_versions`, -1 on padding) and a row's version
is its oldest token's (`policy_version`). Single-turn only.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

import torch

from controller.rollout_buffer import BufferedRollout, RolloutBuffer
from controller.weight_publisher import RolloutTurn
from engines.rollout.base import Completion, SamplingParams, read_special_token_ids
from schema.async_rl import resolved_lanes
from workers.batch import Batch, prompt_length_of, sampling_of
from workers.remote import wait_all
from workers.rollout_layout import place_rows, rollout_tensors

if TYPE_CHECKING:
    from controller.trainer import Trainer

WAIT_TIMEOUT_S = 3600.0  # a generation call's own timeout bounds the lanes; this bounds their waits
SEGMENT_SEED_STRIDE = 1_000_033  # each segment samples with a seed of its own


class RolloutProducer:
    """One lane for the whole group (a draw split over its workers, as sync does), or one per rollout
    worker (trainer.rollout_lanes) sending whole draws, so that several draws' environment steps overlap."""

    def __init__(
        self, trainer: Trainer, turn: RolloutTurn, buffer: RolloutBuffer, next_index: int, skip: set[int]
    ) -> None:
        self.trainer, self.turn, self.buffer, self.next_index = trainer, turn, buffer, next_index
        self.skip = skip  # draws trained before the checkpoint that resumed this run
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
        """The next draw not trained yet: its index and prompts."""
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
                lambda rows, params: self._call(actor, "generate", (rows, params), who),
                lambda: self.turn.generation(WAIT_TIMEOUT_S, who),
                lambda: self.buffer.version,  # the weights on the rollout workers
                self.pad,
            )
            waited, version = time.perf_counter() - start - busy, int(batch.tensors["policy_version"].min())
        else:
            with self.turn.generation(WAIT_TIMEOUT_S, who) as waited:
                version, start = self.buffer.version, time.perf_counter()
                batch = self._call(actor, "generate_sequences", (prompts,), who)
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

    def _call(self, actor: Any, method: str, args: tuple, who: str) -> Any:
        """`method` of the rollout role: on the whole group, or on the lane's own worker."""
        rollout = self.trainer.job.groups.actor.rollout
        if actor is None:
            return getattr(rollout, method)(*args)
        ref = actor.execute.remote(method, (args, {}))
        return wait_all(who, method, [ref], rollout.group.call_timeout_s)[0]

    def resume_point(self) -> tuple[int, dict[str, Any], list[int]]:
        """(index, loader state before it) of the oldest draw not trained, and the later ones trained."""
        with self.lock:
            first = self._first_untrained()
            loader = self.loader_states.get(first) or self.trainer.job.loader.state_dict()
            return first, loader, sorted(i for i in self.trained_draws if i > first)

    def trained(self, index: int) -> None:
        with self.lock:
            self.trained_draws.add(index)
            first = self._first_untrained()
            self.trained_draws = {i for i in self.trained_draws if i > first}
            for old in [i for i in self.loader_states if i < first]:
                del self.loader_states[old]

    def _first_untrained(self) -> int:
        return min([*self.buffer.pending_indices(), *self.in_flight, self.next_index])


def generate_in_segments(
    prompts: Batch,
    segment_tokens: int,
    generate: Callable[[list[list[int]], SamplingParams], list[Completion]],
    turn: Callable[[], AbstractContextManager[Any]],
    version: Callable[[], int],
    pad: int,
) -> tuple[Batch, float]:
    """The draw's training layout with `token_versions` and `policy_version`, and the seconds spent in
    generation calls. `turn()` holds the rollout workers for one call; `version()` is then theirs."""
    params = sampling_of(prompts)
    assert params is not None, "a draw carries its SamplingParams (JobSetup.next_prompts)"
    rows = [list(map(int, p)) for p in prompts.non_tensors["prompt_ids"]]
    budget = params.max_new_tokens
    tokens: list[list[int]] = [[] for _ in rows]
    log_probs: list[list[float]] = [[] for _ in rows]
    versions: list[list[int]] = [[] for _ in rows]
    finish = ["length"] * len(rows)
    live, segment, busy = list(range(len(rows))), 0, 0.0
    while live:
        room = min(segment_tokens, *(budget - len(tokens[i]) for i in live))
        seed = None if params.seed is None else params.seed + SEGMENT_SEED_STRIDE * segment
        step = params.model_copy(update={"n": 1, "max_new_tokens": room, "seed": seed})
        with turn():
            current, start = version(), time.perf_counter()
            completions = generate([rows[i] + tokens[i] for i in live], step)
            busy += time.perf_counter() - start
        still = []
        for i, comp in zip(live, completions, strict=True):
            tokens[i] += comp.token_ids
            log_probs[i] += comp.log_probs
            versions[i] += [current] * len(comp.token_ids)
            finish[i] = comp.finish_reason
            if comp.finish_reason == "length" and len(tokens[i]) < budget:
                still.append(i)
        live, segment = still, segment + 1
    merged = [Completion(t, lp, f) for t, lp, f in zip(tokens, log_probs, finish, strict=True)]
    width = prompt_length_of(prompts) or max(len(p) for p in rows)
    tensors = rollout_tensors(rows, merged, width, budget, pad)
    token_versions = torch.full((len(rows), budget), -1, dtype=torch.long)
    place_rows(token_versions, versions)
    tensors["token_versions"] = token_versions
    oldest = [min(v) if v else version() for v in versions]
    tensors["policy_version"] = torch.tensor(oldest, dtype=torch.long)
    return Batch(tensors, prompts.non_tensors, prompts.meta), busy
