"""Asynchronous RL (trainer.mode 'async'): the rollout workers generate while the training ranks update.

`AsyncTrainer` is the Trainer with one change of source: a step's scored samples come from a bounded
buffer (controller/rollout_buffer.py) that producer threads of the controller fill, instead of a
generation inside the step. The rest of the step (log-probs, advantages, update, sync, records,
checkpoints, recovery) is Trainer.step's.

    producer thread (RolloutProducer)                 trainer thread (Trainer.step)
    admit B samples (AReaL's rule, the buffer)        take the oldest batch young enough
    draw prompts i (seed of i), generate on the       (older ones dropped: async/dropped_stale)
      rollout workers, score, put                     log-probs, advantages, update_actor
    ... next i while the trainer updates ...          sync: now if no generation call is in flight,
                                                      else deferred until the workers are free

Weights reach the rollout workers **between their generation calls** (controller/rollout_turn.py,
every wait with a timeout naming the worker group): a rollout worker serves one call at a time, so
a step's sync goes at once when no call is in flight (always with k = 0), else the newest weights go
as soon as the workers are free (checked while the trainer waits for a batch, and before a
validation). The controller therefore knows the version every generation call ran with. Versions
count optimizer steps: step s trains at version s - 1, and a sample of version v has staleness
s - 1 - v <= trainer.max_staleness (asserted on every trained sample by tests/test_async_rl.py).

k = 0 computes what the sync trainer computes: the buffer admits draw i only once the weights of
version i - 1 are on the rollout workers, draw i takes the loader's i-th prompts and the sampling
seed of sync step i, so step i trains the samples sync step i would have.

Exact resume: a checkpoint records the loader position before the oldest draw not yet trained
(buffered or in flight) and that draw's index; in-flight and buffered samples are **regenerated**
after a resume (with the checkpoint's weights), never trained twice: every draw trained before the
checkpoint has a smaller index (one producer, a FIFO buffer).

Off-policy correction (trainer.off_policy_correction) is the loss's existing machinery set by
`corrected_spec` (controller/off_policy.py: the formulas and sources, with workers/losses/rollout_correction.py);
behaviour_ppo also swaps the actor batch's old log-probs for the behaviour ones (`_actor_inputs`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from controller.async_config import buffer_capacity, resolved_lanes, staleness_bound
from controller.off_policy import behaviour_as_old, corrected_spec
from controller.overlong import apply_overlong
from controller.partial_rollout import generate_in_segments
from controller.rollout_buffer import BufferedRollout, BufferTimeout, RolloutBuffer
from controller.rollout_turn import RolloutTurn
from controller.sink import JobSink
from controller.spec import JobSpec
from controller.trainer import Trainer
from controller.worker_group import DEFAULT_ROLE
from engines.rollout.hf import read_special_token_ids
from workers.remote import wait_all

WAIT_TIMEOUT_S = 3600.0  # a generation call's own timeout bounds the producer; this bounds the waits
POLL_S = 0.05  # the trainer's wait for a batch checks this often whether a deferred sync can go
SYNC_GRACE_S = 0.05  # a step's sync waits this long for the generation calls in flight to end


def make_trainer(
    spec: JobSpec, workdir: str | Path, sink: JobSink, name: str = "job", restarts: int = 0
) -> Trainer:
    """The job's trainer: the async one for trainer.mode 'async'."""
    cls = AsyncTrainer if spec.trainer.mode == "async" else Trainer
    return cls(spec, workdir, sink, name=name, restarts=restarts)


class RolloutProducer:
    """Controller threads ("lanes") that keep the rollout workers generating into the buffer: one lane
    for the whole group (a draw split over its workers, as sync does), or one per rollout worker
    (trainer.rollout_lanes), each sending whole draws to its worker, so that several draws' slow
    environment steps overlap."""

    def __init__(self, trainer: AsyncTrainer, buffer: RolloutBuffer, next_index: int, skip: set[int]) -> None:
        self.trainer, self.buffer, self.next_index = trainer, buffer, next_index
        self.skip = skip  # draws trained before the checkpoint that resumed this run
        self.version = buffer.version  # the weights on the rollout workers (set by the trainer's sync)
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
        samples = self.trainer.batch_samples
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
                lambda: self.trainer.turn.generation(WAIT_TIMEOUT_S, who),
                lambda: self.version,
                self.pad,
            )
            waited, version = time.perf_counter() - start - busy, int(batch.tensors["policy_version"].min())
        else:
            with self.trainer.turn.generation(WAIT_TIMEOUT_S, who) as waited:
                version, start = self.version, time.perf_counter()
                batch = self._generate(actor, prompts, who)
                busy = time.perf_counter() - start
            batch.tensors["policy_version"] = torch.full((len(batch),), version, dtype=torch.long)
        batch, scores, metrics = self.trainer.score(batch)
        batch, scores, overlong = apply_overlong(
            batch, scores, spec.algorithm.overlong, spec.rollout.response_budget
        )
        tokens = float(batch.tensors["response_mask"].sum())
        with self.lock:
            self.stats["wait_s"] += waited
            self.stats["busy_s"] += busy
            self.stats["tokens"] += tokens
        payload = (batch, scores, {**metrics, **overlong})
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


class AsyncTrainer(Trainer):
    """Trainer.step fed by the rollout buffer; see the module docstring."""

    def __init__(self, spec: JobSpec, *args: Any, **kwargs: Any) -> None:
        self._asked_proximal = spec.algorithm.recompute_old_log_probs  # the user's, before the correction's
        super().__init__(corrected_spec(spec), *args, **kwargs)
        self.turn = RolloutTurn(sync_first=self.spec.trainer.partial_rollouts)
        self.producer: RolloutProducer | None = None
        self._next_index: int | None = None  # from a checkpoint: the first draw not trained
        self._skip: set[int] = set()  # from a checkpoint: later draws already trained
        self._sync_pending = False  # the rollout workers hold older weights than the trainer
        self._score_lock = threading.Lock()  # the scorer's processes serve one thread at a time
        self._dropped_total = 0
        self.max_staleness = staleness_bound(self.spec)  # trainer.max_staleness, None resolved

    @property
    def batch_samples(self) -> int:
        external = self.spec.rollout.external_config
        if external is not None:  # one sample per agent trajectory
            return external.trajectories_per_step
        return self.spec.trainer.prompts_per_step * self.spec.rollout.n

    def _needs_old_log_probs(self, samples: int) -> bool:
        """behaviour_ppo's old policy is the behaviour one: the proximal pass runs only for what else
        reads it (KL in the reward, rollout rejection). decoupled's pass is skipped when the update is
        one optimizer step (and the user did not ask for the pass): the update's first forward, detached,
        is pi_prox exactly, as for tis, so the pass would compute the same numbers again (a forward a
        step, which a compute-bound job pays for: bench/RESULTS.md)."""
        a, choice = self.spec.algorithm, self.spec.trainer.off_policy_correction
        if choice == "behaviour_ppo":
            return a.recompute_old_log_probs or a.kl_in_reward or a.rollout_correction.rejection != "off"
        if choice == "decoupled" and not self._asked_proximal:
            single_step = a.ppo_epochs == 1 and a.ppo_mini_batch_size in (None, samples)
            return not single_step or a.kl_in_reward or a.rollout_correction.rejection != "off"
        return super()._needs_old_log_probs(samples)

    def _actor_inputs(self, batch: Any) -> Any:
        if self.spec.trainer.off_policy_correction == "behaviour_ppo":
            return behaviour_as_old(batch)
        return batch

    # ---- the producer's start and end ----------------------------------------------------------

    def _ensure_producer(self) -> RolloutProducer:
        if self.producer is None:
            version = self.step_index - 1
            capacity = buffer_capacity(self.spec, self.batch_samples)
            buffer = RolloutBuffer(self.batch_samples, self.max_staleness, capacity, version=version)
            next_index = self._next_index if self._next_index is not None else self.step_index
            self.producer = RolloutProducer(self, buffer, next_index, set(self._skip))
            self.producer.start()
        return self.producer

    def _end_attempt(self) -> None:
        if self.producer is not None:
            self.producer.close()
        self.producer, self._next_index, self._skip = None, None, set()

    # ---- the step's sources ----------------------------------------------------------------------

    def _sample(self) -> tuple[Any, Any, dict[str, float]]:
        if self.external is not None:
            return self._external_sample()
        producer = self._ensure_producer()
        version, start, synced = self.step_index - 1, time.perf_counter(), {}
        with self._timed("wait_rollout"):
            while True:  # a deferred sync goes out as soon as the rollout workers are free
                if self._sync_pending and self.turn.try_sync():
                    synced = self._synced(self._send_weights())
                try:
                    item, dropped = producer.buffer.take(version, POLL_S, f"trainer of job {self.name}")
                    break
                except BufferTimeout:
                    if time.perf_counter() - start > WAIT_TIMEOUT_S:
                        raise
        waited = time.perf_counter() - start
        producer.trained(item.index)
        batch, scores, metrics = item.payload
        self._dropped_total += sum(d.samples for d in dropped)
        stats = producer.take_stats()
        metrics = {**metrics, **synced}
        metrics.update(
            {
                "async/buffer_fill": producer.buffer.buffered_samples() / producer.buffer.capacity,
                "async/dropped_stale": float(sum(d.samples for d in dropped)),
                "async/dropped_stale_total": float(self._dropped_total),
                "async/draw_index": float(item.index),
                "async/trainer_wait_s": waited,
                "async/rollout_wait_s": stats["wait_s"],
                "perf/rollout_tokens_per_s": stats["tokens"] / max(stats["busy_s"], 1e-9),
            }
        )
        return batch, scores, self._with_staleness(metrics, batch, version)

    def _external_sample(self) -> tuple[Any, Any, dict[str, float]]:
        """rollout.source external: a step's rewarded groups from the endpoint's buffer (controller/
        external.py admits, buffers and filters them), scored as the sync trainer scores them."""
        version, start, pad = self.step_index - 1, time.perf_counter(), self.job.tokenizer.pad_token_id or 0
        with self._timed("wait_rollout"):
            got = self.external.next_async(version, lambda: self.control.stop_reason is not None, pad)
        if got is None:  # a pause or cancel while waiting for agents: as the sync trainer's
            self.step_index -= 1
            self._check_stop()
        batch, counts = got
        batch, scores, metrics = self._rewards(batch)
        batch, scores, overlong = apply_overlong(
            batch, scores, self.spec.algorithm.overlong, self.spec.rollout.response_budget
        )
        dropped, self._dropped_total = counts["dropped_total"] - self._dropped_total, counts["dropped_total"]
        metrics.update(overlong)
        metrics.update(
            {
                "async/buffer_fill": counts["fill"],
                "async/dropped_stale": float(dropped),
                "async/dropped_stale_total": float(self._dropped_total),
                "async/trainer_wait_s": time.perf_counter() - start,
            }
        )
        return batch, scores, self._with_staleness(metrics, batch, version)

    def _with_staleness(self, metrics: dict[str, float], batch: Any, version: int) -> dict[str, float]:
        """The trained samples' staleness (trainer version minus their oldest token's version)."""
        staleness = version - batch.tensors["policy_version"]
        if int(staleness.max()) > self.max_staleness:  # the buffer's filter makes this impossible
            raise RuntimeError(f"a sample of staleness {int(staleness.max())} reached the update")
        metrics["async/staleness_mean"] = float(staleness.float().mean())
        metrics["async/staleness_max"] = float(staleness.max())
        if (
            "token_versions" in batch.tensors.keys()
        ):  # partial rollouts: rows sampled by more than one version
            tv = batch.tensors["token_versions"]
            newest = tv.max(-1).values
            oldest = tv.masked_fill(tv < 0, torch.iinfo(tv.dtype).max).min(-1).values
            metrics["async/multi_version_samples"] = float(((newest > oldest) & (newest >= 0)).sum())
        for age in range(self.max_staleness + 1):  # the histogram of trained samples
            metrics[f"async/staleness_hist/{age}"] = float((staleness == age).sum())
        return metrics

    def _start_sync(self) -> Callable[[], dict[str, float]]:
        """The step's weights go out now if no generation call is in flight (k = 0: always, the
        producer waits for them); else later, before the next take, as soon as the workers are free
        (the newest weights then: a skipped version is never sent)."""
        if self.external is not None:  # the endpoint's calls and the sync queue on the rollout workers
            return self._external_sync()
        self._sync_pending = True
        if not self.turn.try_sync(SYNC_GRACE_S):
            return dict
        return self._send_weights()

    def _external_sync(self) -> Callable[[], dict[str, float]]:
        """rollout.source external: the weights go at once; a rollout worker runs one call at a time, so
        they land between the endpoint's generation calls, and the buffer's admission widens after."""
        done, version = super()._start_sync(), self.step_index

        def wait() -> dict[str, float]:
            out = done()
            self.external.set_version(version)
            return out

        return wait

    def _send_weights(self, release: bool = True) -> Callable[[], dict[str, float]]:
        """Send the trainer's weights (the turn is the sync's); the producer resumes once they are there
        (`release` False: the caller keeps the turn and releases it)."""
        producer, version = self._ensure_producer(), self.step_index
        try:
            done = super()._start_sync()
        except BaseException:
            if release:
                self.turn.release()
            raise

        def wait() -> dict[str, float]:
            try:
                out = done()
                self._sync_pending = False
                producer.version = version
                producer.buffer.set_version(version)
                return out
            finally:
                if release:
                    self.turn.release()

        return wait

    def _generate(self, prompts: Any) -> Any:
        """Validation's generation: the rollout workers to itself (the lanes wait, as the trainer does,
        so a validation costs async what it costs sync), the trainer's weights first (a deferred sync
        goes now), then the validation prompts."""
        if not self.turn.hold(WAIT_TIMEOUT_S):
            raise TimeoutError(f"rollout workers of job {self.name}: busy for {WAIT_TIMEOUT_S:.0f} s")
        try:
            if self._sync_pending and self.producer is not None:
                self._synced(self._send_weights(release=False))
            return super()._generate(prompts)
        finally:
            self.turn.release()

    def _rewards(self, batch: Any) -> tuple[Any, Any, dict[str, float]]:
        with self._score_lock:
            return super()._rewards(batch)

    score = _rewards

    def _replace_rollout(self, err: Exception) -> dict[str, float]:
        """Async: a lost rollout worker restarts the job from its checkpoint (in-flight samples are
        regenerated); replacing it alone inside a step is the sync trainer's."""
        raise err

    def _finish_metrics(self, metrics: dict[str, float], batch: Any) -> dict[str, float]:
        metrics = super()._finish_metrics(metrics, batch)
        busy = self._timings.get("step", 0.0) - self._timings.get("wait_rollout", 0.0)
        metrics["perf/trainer_tokens_per_s"] = metrics["perf/total_num_tokens"] / max(busy, 1e-9)
        return metrics

    # ---- checkpoints -----------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        if self.producer is not None:
            index, loader, trained = self.producer.resume_point()
        else:
            index, loader, trained = (
                self._next_index or self.step_index + 1,
                state["loader"],
                sorted(self._skip),
            )
        state.update(loader=loader, draw_index=index, trained_draws=trained)
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)  # the loader goes to the oldest untrained draw
        self._next_index = int(state.get("draw_index", self.step_index + 1))
        self._skip = set(state.get("trained_draws", []))
