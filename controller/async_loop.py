"""Asynchronous RL (trainer.mode 'async'): the rollout workers generate while the training ranks update.

`AsyncTrainer` is the Trainer with one change of source: a step's scored samples come from a bounded
buffer (controller/rollout_buffer.py) that a producer thread of the controller fills, instead of a
generation inside the step. The rest of the step (log-probs, advantages, update, sync, records,
checkpoints, recovery) is Trainer.step's.

    producer thread (RolloutProducer)                 trainer thread (Trainer.step)
    admit B samples (AReaL's rule, the buffer)        take the oldest batch young enough
    draw prompts i (seed of i), generate on the       (older ones dropped: async/dropped_stale)
      rollout workers, score, put                     log-probs, advantages, update_actor
    ... next i while the trainer updates ...          sync: wait for the current generation call,
                                                      send the weights, release the workers

Weights reach the rollout workers **between their generation calls**: a rollout worker serves one
call at a time, so a sync waits for the call in flight (`RolloutTurn`, with a timeout naming the
worker group), and the producer's next call starts only after the sync. The controller therefore
knows the version every generation call ran with: the trainer version at the last sync. Versions count
optimizer steps: step s trains at version s - 1, and a sample of version v has staleness
s - 1 - v <= trainer.max_staleness (asserted on every trained sample by tests/test_async_rl.py).

k = 0 computes what the sync trainer computes: the buffer admits draw i only once the weights of
version i - 1 are on the rollout workers, draw i takes the loader's i-th prompts and the sampling
seed of sync step i, so step i trains the samples sync step i would have.

Exact resume: a checkpoint records the loader position before the oldest draw not yet trained
(buffered or in flight) and that draw's index; in-flight and buffered samples are **regenerated**
after a resume (with the checkpoint's weights), never trained twice: every draw trained before the
checkpoint has a smaller index (one producer, a FIFO buffer).

Off-policy correction (trainer.off_policy_correction) is the loss's existing machinery set by
`corrected_spec`; the formulas and sources are in its docstring and workers/losses/rollout_correction.py.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from controller.overlong import apply_overlong
from controller.rollout_buffer import BufferedRollout, RolloutBuffer
from controller.sink import JobSink
from controller.spec import JobSpec
from controller.trainer import Trainer

WAIT_TIMEOUT_S = 3600.0  # a generation call's own timeout bounds the producer; this bounds the waits


def corrected_spec(spec: JobSpec) -> JobSpec:
    """The spec whose loss applies trainer.off_policy_correction. With pi_behav the rollout engine's
    log-probs (kept per token), pi_prox the trainer's recomputed log-probs before the update, C =
    algorithm.rollout_correction.is_cap, r = pi_theta / pi_prox, A the advantage:

    decoupled   L = - min(pi_prox / pi_behav, C) * min(r A, clip(r, 1 - eps_low, 1 + eps_high) A)
                Fu et al. 2025, "AReaL", eq. 5 (the decoupled PPO objective: the trust region is
                around the proximal policy, the behaviour weight corrects the sampling); AReaL
                masks tokens past the cap, this truncates them (Yao et al. 2025). Needs the proximal
                pass: algorithm.recompute_old_log_probs is set.
    tis         L = - min(pi_theta.detach() / pi_behav, C) * min(r A, clip(r) A) with pi_prox =
                pi_theta.detach(): for one epoch r = 1, an unclipped, truncated importance-sampling
                loss (Yao et al. 2025), the one tinker-cookbook PR #822 found unstable off-policy.
    none        the sync loss unchanged (samples treated as on-policy).

    Both weights are the token-level TIS of workers/losses/rollout_correction.py (`is_weights`), a
    level the user set ('sequence') is kept."""
    choice = spec.trainer.off_policy_correction
    if spec.trainer.mode != "async" or choice == "none":
        return spec
    correction = spec.algorithm.rollout_correction
    level = correction.is_weights if correction.is_weights != "off" else "token"
    algorithm: dict[str, Any] = {"rollout_correction": {"is_weights": level}}
    if choice == "decoupled":
        algorithm["recompute_old_log_probs"] = True
    return spec.merged({"algorithm": algorithm})


def make_trainer(
    spec: JobSpec, workdir: str | Path, sink: JobSink, name: str = "job", restarts: int = 0
) -> Trainer:
    """The job's trainer: the async one for trainer.mode 'async'."""
    cls = AsyncTrainer if spec.trainer.mode == "async" else Trainer
    return cls(spec, workdir, sink, name=name, restarts=restarts)


class RolloutTurn:
    """The rollout workers serve one caller at a time: a generation call, or a weight sync. A waiting
    sync goes first: the producer starts no new call until it is done."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._busy = False
        self._syncs_waiting = 0

    @contextmanager
    def generation(self, timeout_s: float, who: str) -> Iterator[float]:
        """Yields the seconds waited for a sync to finish."""
        start = time.perf_counter()
        with self._cond:
            if not self._cond.wait_for(lambda: not self._busy and not self._syncs_waiting, timeout_s):
                raise TimeoutError(f"{who}: the rollout workers were not free within {timeout_s:.0f} s")
            self._busy = True
        try:
            yield time.perf_counter() - start
        finally:
            self._release()

    def acquire_for_sync(self, timeout_s: float, who: str) -> float:
        """Wait for the generation call in flight; returns the seconds waited (then `release`)."""
        start = time.perf_counter()
        with self._cond:
            self._syncs_waiting += 1
            try:
                if not self._cond.wait_for(lambda: not self._busy, timeout_s):
                    raise TimeoutError(
                        f"{who}: its generation call did not end within {timeout_s:.0f} s, the weights wait"
                    )
                self._busy = True
            finally:
                self._syncs_waiting -= 1
        return time.perf_counter() - start

    def _release(self) -> None:
        with self._cond:
            self._busy = False
            self._cond.notify_all()

    release = _release


class RolloutProducer:
    """The controller thread that keeps the rollout workers generating into the buffer."""

    def __init__(self, trainer: AsyncTrainer, buffer: RolloutBuffer, next_index: int) -> None:
        self.trainer, self.buffer, self.next_index = trainer, buffer, next_index
        self.version = buffer.version  # the weights on the rollout workers (set by the trainer's sync)
        self.stop = threading.Event()
        self.lock = threading.Lock()  # guards next_index, current and loader_states against state_dict
        self.current: int | None = None  # the draw in flight
        self.loader_states: dict[int, dict[str, Any]] = {}  # the loader before each untrained draw
        self.stats = {"wait_s": 0.0, "busy_s": 0.0, "tokens": 0.0}
        self.thread = threading.Thread(target=self._run, name=f"rollout-producer-{trainer.name}", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def close(self, timeout_s: float = 30.0) -> None:
        self.stop.set()
        self.thread.join(timeout_s)  # a call in flight ends with its workers (the group shuts down next)

    def take_stats(self) -> dict[str, float]:
        with self.lock:
            stats, self.stats = self.stats, {"wait_s": 0.0, "busy_s": 0.0, "tokens": 0.0}
        return stats

    def _run(self) -> None:
        samples = self.trainer.batch_samples
        who = f"rollout workers of job {self.trainer.name}"
        try:
            while not self.stop.is_set():
                start = time.perf_counter()
                if not self.buffer.admit(samples, WAIT_TIMEOUT_S, who, self.stop):
                    return
                waited = time.perf_counter() - start
                try:
                    item = self._produce(who)
                except BaseException:
                    self.buffer.cancel(samples)
                    raise
                with self.lock:
                    self.stats["wait_s"] += waited
                    self.current = None
                if item is None:
                    return
                self.buffer.put(item)
        except BaseException as err:  # noqa: BLE001 -- handed to the trainer, which raises it
            self.buffer.fail(err)

    def _produce(self, who: str) -> BufferedRollout | None:
        job, spec = self.trainer.job, self.trainer.spec
        with self.lock:
            index, self.current = self.next_index, self.next_index
            self.loader_states[index] = job.loader.state_dict()
            prompts = job.next_prompts(index)  # draw i: the loader's i-th prompts, sync step i's seed
            self.next_index += 1
        if self.stop.is_set():
            return None
        with self.trainer.turn.generation(WAIT_TIMEOUT_S, who) as waited:
            version, start = self.version, time.perf_counter()
            batch = job.groups.actor.generate_sequences(prompts)
            busy = time.perf_counter() - start
        batch, scores, metrics = self.trainer.score(batch)
        batch, scores, overlong = apply_overlong(
            batch, scores, spec.algorithm.overlong, spec.rollout.response_budget
        )
        tokens = float(batch.tensors["response_mask"].sum())
        batch.tensors["policy_version"] = torch.full((len(batch),), version, dtype=torch.long)
        with self.lock:
            self.stats["wait_s"] += waited
            self.stats["busy_s"] += busy
            self.stats["tokens"] += tokens
        payload = (batch, scores, {**metrics, **overlong})
        return BufferedRollout(index, len(batch), version, payload, int(tokens))

    def resume_point(self) -> tuple[int, dict[str, Any]]:
        """(index, loader state before it) of the oldest draw not yet trained."""
        with self.lock:
            pending = self.buffer.pending_indices() + ([self.current] if self.current is not None else [])
            if not pending:
                return self.next_index, self.trainer.job.loader.state_dict()
            first = min(pending)
            return first, self.loader_states[first]

    def trained(self, index: int) -> None:
        with self.lock:
            for old in [i for i in self.loader_states if i <= index]:
                del self.loader_states[old]


class AsyncTrainer(Trainer):
    """Trainer.step fed by the rollout buffer; see the module docstring."""

    def __init__(self, spec: JobSpec, *args: Any, **kwargs: Any) -> None:
        super().__init__(corrected_spec(spec), *args, **kwargs)
        self.turn = RolloutTurn()
        self.producer: RolloutProducer | None = None
        self._next_index: int | None = None  # from a checkpoint: the first draw not trained
        self._score_lock = threading.Lock()  # the scorer's processes serve one thread at a time
        self._trainer_wait = 0.0
        self._dropped_total = 0

    @property
    def batch_samples(self) -> int:
        return self.spec.trainer.prompts_per_step * self.spec.rollout.n

    # ---- the producer's start and end ----------------------------------------------------------

    def _ensure_producer(self) -> RolloutProducer:
        if self.producer is None:
            t, version = self.spec.trainer, self.step_index - 1
            capacity = t.buffer_size or (t.max_staleness + 1) * self.batch_samples
            buffer = RolloutBuffer(self.batch_samples, t.max_staleness, capacity, version=version)
            next_index = self._next_index if self._next_index is not None else self.step_index
            self.producer = RolloutProducer(self, buffer, next_index)
            self.producer.start()
        return self.producer

    def _end_attempt(self) -> None:
        if self.producer is not None:
            self.producer.close()
        self.producer, self._next_index = None, None

    # ---- the step's sources ----------------------------------------------------------------------

    def _sample(self) -> tuple[Any, Any, dict[str, float]]:
        producer = self._ensure_producer()
        version, start = self.step_index - 1, time.perf_counter()
        with self._timed("wait_rollout"):
            item, dropped = producer.buffer.take(version, WAIT_TIMEOUT_S, f"trainer of job {self.name}")
        waited = time.perf_counter() - start
        producer.trained(item.index)
        batch, scores, metrics = item.payload
        staleness = version - batch.tensors["policy_version"]
        if (
            int(staleness.max()) > self.spec.trainer.max_staleness
        ):  # the buffer's filter makes this impossible
            raise RuntimeError(f"a sample of staleness {int(staleness.max())} reached the update")
        self._dropped_total += sum(d.samples for d in dropped)
        stats = producer.take_stats()
        metrics = dict(metrics)
        metrics.update(
            {
                "async/buffer_fill": producer.buffer.buffered_samples() / producer.buffer.capacity,
                "async/dropped_stale": float(sum(d.samples for d in dropped)),
                "async/dropped_stale_total": float(self._dropped_total),
                "async/staleness_mean": float(staleness.float().mean()),
                "async/staleness_max": float(staleness.max()),
                "async/draw_index": float(item.index),
                "async/trainer_wait_s": waited + self._trainer_wait,
                "async/rollout_wait_s": stats["wait_s"],
                "perf/rollout_tokens_per_s": stats["tokens"] / max(stats["busy_s"], 1e-9),
            }
        )
        for age in range(self.spec.trainer.max_staleness + 1):  # the histogram of trained samples
            metrics[f"async/staleness_hist/{age}"] = float((staleness == age).sum())
        self._trainer_wait = 0.0
        return batch, scores, metrics

    def _start_sync(self) -> Callable[[], dict[str, float]]:
        """Wait for the rollout workers' generation call in flight, then send; the producer resumes
        once the weights are there."""
        producer = self._ensure_producer()
        self._trainer_wait += self.turn.acquire_for_sync(
            WAIT_TIMEOUT_S, f"rollout workers of job {self.name}"
        )
        try:
            done = super()._start_sync()
        except BaseException:
            self.turn.release()
            raise

        def wait() -> dict[str, float]:
            try:
                return done()
            finally:
                producer.version = self.step_index
                producer.buffer.set_version(self.step_index)
                self.turn.release()

        return wait

    def _generate(self, prompts: Any) -> Any:
        """Validation's generation takes its turn on the rollout workers."""
        with self.turn.generation(WAIT_TIMEOUT_S, f"rollout workers of job {self.name}"):
            return super()._generate(prompts)

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
            index, loader = self.producer.resume_point()
        else:
            index, loader = self._next_index or self.step_index + 1, state["loader"]
        state.update(loader=loader, draw_index=index)
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)  # the loader goes to the oldest untrained draw
        self._next_index = int(state.get("draw_index", self.step_index + 1))
