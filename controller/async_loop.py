"""Asynchronous RL (trainer.mode 'async'): `Trainer.step` with its sync point moved.

Lanes (controller threads) keep the rollout workers generating into a bounded rollout buffer while the
trainer updates: one lane for the whole group (a draw split over its workers, as sync does), or one per
rollout worker (trainer.rollout_lanes) sending whole draws, so that several draws' environment steps
overlap. Weights go back at the next safe point (controller/weight_publisher.py). Step s trains at
version s - 1 on samples of staleness <= trainer.max_staleness; k = 0 computes what sync computes
(draw i: the loader's i-th prompts, sync step i's seed, admitted once version i - 1 is on the
workers). A checkpoint records the oldest draw not trained and the later ones trained, so a resumed
job trains no draw twice.

With partial rollouts (trainer.partial_rollouts) each segment is one generation call, so a weight sync
lands between segments; every token keeps the version that sampled it (`token_versions`, -1 on
padding) and a row's version is its oldest token's (`policy_version`). Single-turn only.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

import torch

from controller.batch_source import BatchSource, Scored, buffer_metrics, staleness_metrics
from controller.rollout_buffer import BufferedRollout, BufferTimeout, RolloutBuffer
from controller.weight_publisher import RolloutTurn, WeightPublisher
from engines.rollout.base import Completion, SamplingParams, read_special_token_ids
from schema.async_rl import batch_samples, buffer_capacity, resolved_lanes, staleness_bound
from workers.batch import Batch, prompt_length_of, sampling_of
from workers.remote import wait_all
from workers.rollout_layout import place_rows, rollout_tensors

if TYPE_CHECKING:
    from controller.trainer import Trainer

POLL_S = 0.05  # the trainer's wait for a batch checks this often whether a pending sync can go
WAIT_TIMEOUT_S = 3600.0  # a generation call's own timeout bounds the lanes; this bounds their waits
SEGMENT_SEED_STRIDE = 1_000_033  # each segment samples with a seed of its own


def _no_counts() -> dict[str, float]:
    return {"wait_s": 0.0, "busy_s": 0.0, "tokens": 0.0}


class LaneSource(BatchSource):
    """The rollout buffer the lanes fill (they start with the first step's wait, after a validation at
    step 0); its `publisher` sends at the next safe point and widens the buffer's admission."""

    def __init__(self, trainer: Trainer) -> None:
        self.trainer = trainer
        self.turn = RolloutTurn(sync_first=trainer.spec.trainer.partial_rollouts)
        self.publisher = WeightPublisher(trainer, self.turn, sent=self._sent)
        self.max_staleness = staleness_bound(trainer.spec)
        self.dropped_total = 0
        self.lock = threading.Lock()  # guards the draw state below against state_dict
        self._reset()

    def _reset(self) -> None:
        """An attempt's lanes and draw state; a checkpoint's (`load_state_dict`) fills `next_index`, `skip`."""
        self.buffer: RolloutBuffer | None = None
        self.lanes: list[threading.Thread] = []
        self.stopping = threading.Event()
        self.next_index: int | None = None  # the next draw (None: the step after the trainer's)
        self.skip: set[int] = set()  # draws trained before the checkpoint that resumed this attempt
        self.in_flight: set[int] = set()
        self.trained_draws: set[int] = set()
        self.loader_states: dict[int, dict[str, Any]] = {}  # the loader before each unsettled draw
        self.counts = _no_counts()

    def next_batch(self) -> Scored:
        t, buffer = self.trainer, self._start_lanes()
        version, start, synced = t.step_index - 1, time.perf_counter(), {}
        with t.timed("wait_rollout"):
            while True:  # a pending sync goes out as soon as the rollout workers are free
                synced = self.publisher.send_pending() or synced
                try:
                    items, dropped = buffer.take(
                        version, buffer.batch_size, POLL_S, f"trainer of job {t.name}"
                    )
                    break
                except BufferTimeout:
                    if time.perf_counter() - start > WAIT_TIMEOUT_S:
                        raise
        waited = time.perf_counter() - start
        item = items[0]  # one draw: a step's samples
        with self.lock:
            self.trained_draws.add(item.index)
            first = self._first_untrained()
            self.trained_draws = {i for i in self.trained_draws if i > first}
            self.loader_states = {i: s for i, s in self.loader_states.items() if i >= first}
            counts, self.counts = self.counts, _no_counts()
        batch, scores, metrics = item.payload
        self.dropped_total += dropped
        fill = buffer.buffered_samples() / buffer.capacity
        metrics = {**metrics, **synced, **buffer_metrics(fill, dropped, self.dropped_total, waited)}
        metrics.update(
            {
                "async/draw_index": float(item.index),
                "async/rollout_wait_s": counts["wait_s"],
                "perf/rollout_tokens_per_s": counts["tokens"] / max(counts["busy_s"], 1e-9),
            }
        )
        return batch, scores, staleness_metrics(metrics, batch, version, self.max_staleness)

    def stop(self, timeout_s: float = 30.0) -> None:
        """The lanes stop; the next attempt starts from its checkpoint (nothing left to send)."""
        self.stopping.set()
        for lane in self.lanes:  # a call in flight ends with its workers (the group shuts down next)
            lane.join(timeout_s)
        with self.lock:  # a lane still in a call past the join touches none of the next attempt's state
            self._reset()
        self.publisher.pending = False

    def _start_lanes(self) -> RolloutBuffer:
        if self.buffer is None:
            t, samples = self.trainer, batch_samples(self.trainer.spec)
            capacity = buffer_capacity(t.spec, samples)
            self.buffer = RolloutBuffer(samples, self.max_staleness, capacity, version=t.step_index - 1)
            if self.next_index is None:
                self.next_index = t.step_index
            self.pad = read_special_token_ids(t.job.model_path)[1]  # the rollout engine's padding
            group = t.job.groups.actor.rollout.group
            actors = group.actors if resolved_lanes(t.spec) == "per_worker" else [None]
            self.lanes = [
                threading.Thread(
                    target=self._run, args=(actor, i), name=f"rollout-lane-{i}-{t.name}", daemon=True
                )
                for i, actor in enumerate(actors)
            ]
            for lane in self.lanes:
                lane.start()
        return self.buffer

    def _sent(self, version: int) -> None:
        """The weights of `version` are on the rollout workers: admission widens to k past it."""
        self._start_lanes().set_version(version)

    def state_dict(self, loader: dict[str, Any]) -> dict[str, Any]:
        """The oldest draw not trained (with the loader state before it), and the later ones trained."""
        with self.lock:
            first = self._first_untrained()
            trained = sorted(i for i in self.trained_draws | self.skip if i > first)
            return {
                "loader": self.loader_states.get(first) or loader,
                "draw_index": first,
                "trained_draws": trained,
            }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.next_index = int(state.get("draw_index", self.trainer.step_index + 1))
        self.skip = set(state.get("trained_draws", []))

    def _first_untrained(self) -> int:
        pending = self.buffer.pending_indices() if self.buffer is not None else []
        upcoming = self.next_index if self.next_index is not None else self.trainer.step_index + 1
        return min([*pending, *self.in_flight, upcoming])

    def _run(self, actor: Any, lane: int) -> None:
        """One lane: admit a draw's samples, generate and score them, put them in the buffer."""
        buffer, stopping, samples = self.buffer, self.stopping, self.buffer.batch_size
        group = self.trainer.job.groups.actor.rollout.group.name
        who = f"rollout group '{group}'" + ("" if actor is None else f", rank {lane}")
        try:
            while not stopping.is_set():
                start = time.perf_counter()
                if not buffer.admit(samples, WAIT_TIMEOUT_S, who, stopping):
                    return
                waited = time.perf_counter() - start
                try:
                    item = self._produce(actor, lane, who, buffer, stopping)
                except BaseException:
                    buffer.cancel(samples)
                    raise
                with self.lock:
                    self.counts["wait_s"] += waited
                if item is None:
                    buffer.cancel(samples)
                    return
                buffer.put(item)
                with self.lock:
                    if not stopping.is_set():
                        self.in_flight.discard(item.index)
        except BaseException as err:  # noqa: BLE001 -- handed to the trainer, which raises it
            buffer.fail(err)

    def _draw(self, stopping: threading.Event) -> tuple[int, Any] | None:
        """The next draw not trained yet: its index and prompts; None once the lanes stop."""
        job = self.trainer.job
        with self.lock:
            while not stopping.is_set():
                index = self.next_index
                self.loader_states[index] = job.loader.state_dict()
                prompts = job.next_prompts(index)
                self.next_index += 1
                if index not in self.skip:
                    self.in_flight.add(index)
                    return index, prompts
                self.skip.discard(index)
                del self.loader_states[index]
        return None

    def _produce(
        self, actor: Any, lane: int, who: str, buffer: RolloutBuffer, stopping: threading.Event
    ) -> BufferedRollout | None:
        spec, drawn = self.trainer.spec, self._draw(stopping)
        if drawn is None:
            return None
        index, prompts = drawn
        if spec.trainer.partial_rollouts:
            start = time.perf_counter()
            batch, busy = generate_in_segments(
                prompts,
                spec.trainer.segment_tokens,
                lambda rows, params: self._call(actor, lane, "generate", (rows, params)),
                lambda: self.turn.generation(WAIT_TIMEOUT_S, who),
                lambda: buffer.version,  # the weights on the rollout workers
                self.pad,
            )
            waited, version = time.perf_counter() - start - busy, int(batch.tensors["policy_version"].min())
        else:
            with self.turn.generation(WAIT_TIMEOUT_S, who) as waited:
                version, start = buffer.version, time.perf_counter()
                batch = self._call(actor, lane, "generate_sequences", (prompts,))
                busy = time.perf_counter() - start
            batch.tensors["policy_version"] = torch.full((len(batch),), version, dtype=torch.long)
        batch, scores, metrics = self.trainer.job.scored(batch)
        tokens = float(batch.tensors["response_mask"].sum())
        with self.lock:
            self.counts["wait_s"] += waited
            self.counts["busy_s"] += busy
            self.counts["tokens"] += tokens
        return BufferedRollout(index, len(batch), version, (batch, scores, metrics), int(tokens))

    def _call(self, actor: Any, lane: int, method: str, args: tuple) -> Any:
        """`method` of the rollout role: on the whole group, or on the lane's own worker (its rank in the
        group: a failure names the group, that rank, its pid and node, as recovery reads them)."""
        rollout = self.trainer.job.groups.actor.rollout
        if actor is None:
            return getattr(rollout, method)(*args)
        ref = actor.execute.remote(method, (args, {}))
        group = rollout.group
        return wait_all(group.name, method, [ref], group.call_timeout_s, group.hosts, ranks=[lane])[0]


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
