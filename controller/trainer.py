"""The single controller of one job: the RL step (docs/ARCHITECTURE.md), and SFT with the same workers.

`Trainer.run()` builds the job, resumes from its checkpoint, then runs one `step()` per iteration with
validation, checkpoints and an HF export at the end. Sync, async and agent-fed jobs share `step()`:
the batch source and the weight publisher differ (controller/batch_source.py). A lost worker restarts
the job from its checkpoint (controller/recovery.py); `control` carries pause, cancel and edits.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Collection, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from controller import checkpoints, step_math
from controller.advantages import KLController
from controller.batch_source import make_source
from controller.hyperparameters import hyperparameter_overrides
from controller.job_setup import JobSetup, needs_reference
from controller.metric_format import format_metric
from controller.recovery import AttemptSink, Recovery, WorkerLost, worker_lost
from controller.resource_pool import ResourcePool, ResourcePoolError
from controller.sink import JobSink
from controller.trajectory_view import step_samples
from schema.job import JobSpec
from schema.workers import UpdateSchedule

log = logging.getLogger("tandem.job")
VALIDATION_WAIT_S = 3600.0  # an async validation waits this long for the lanes' calls in flight


class StopRequested(Exception):
    """The controller was asked to pause or cancel."""


class TrainerControl:
    """Thread-safe requests from outside the loop: stop (pause | cancel) and hyper-parameter edits."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.stop_reason: str | None = None
        self._pending: dict[str, Any] = {}
        self.checkpoint_now = False

    def request_stop(self, reason: str) -> None:
        with self._lock:
            self.stop_reason = reason

    def set_hyperparameters(self, values: dict[str, Any]) -> None:
        with self._lock:
            self._pending.update(values)

    def take_hyperparameters(self) -> dict[str, Any]:
        with self._lock:
            pending, self._pending = self._pending, {}
        return pending


class Trainer:
    def __init__(
        self, spec: JobSpec, workdir: str | Path, sink: JobSink, name: str = "job", restarts: int = 0
    ) -> None:
        # `restarts`: the job's restarts before this run (trainer.max_restarts is the job's budget).
        self.asked_proximal = spec.algorithm.recompute_old_log_probs  # the user's, before the correction's
        self.spec, self.workdir, self.name = step_math.corrected_spec(spec), Path(workdir), name
        self.sink = AttemptSink(sink)  # marks what a restarted attempt records
        self.control = TrainerControl()
        self.recovery = Recovery(spec.trainer, earlier=restarts)
        self.sink.attempt = self.recovery.attempt
        self.job: JobSetup | None = None  # the current attempt's model, data and workers
        self._placed: ResourcePool | None = None  # a restart's training pool, placed while it waited
        self.step_index = 0  # the step being run, or the last one run
        self.completed_steps = 0  # steps whose metrics are recorded (or restored from a checkpoint)
        self._reset_kl()
        self._timings: dict[str, float] = {}
        self.source, self.publisher = make_source(self)  # where samples come from, how weights go back

    def run(self) -> dict[str, float]:
        """Train to total_steps (or trainer.stop_at_val_accuracy, or a stop); the last step's metrics."""
        spec = self.spec
        log.info("job %s: %s on %s, %d steps", self.name, spec.method, spec.model, spec.trainer.total_steps)
        lost: WorkerLost | None = None
        try:
            while True:
                try:
                    if lost is not None:
                        self._recover(lost)
                    return self._run_attempt()
                except WorkerLost as err:
                    lost = err
        finally:
            self.source.close()

    def _run_attempt(self) -> dict[str, float]:
        self.job, pool, self._placed = None, self._placed, None
        last: dict[str, float] = {}
        try:
            self.job = JobSetup.build(self.spec, self.workdir, self.sink, self.name, pool)
            self._resume()
            self.source.start()  # after the checkpoint's weights reached the rollout workers
            self.recovery.resumed()
            total = self.spec.trainer.total_steps
            if self.step_index == 0 and self.spec.trainer.val_every:
                self.sink.metrics(0, self.validate())
            while self.step_index < total:
                self._apply_hyperparameters()
                self.step_index += 1
                last = self.sft_step() if self.spec.method == "sft" else self.step()
                if self.spec.trainer.val_every and (
                    self._due(self.spec.trainer.val_every) or self.step_index == total
                ):
                    last.update(self.validate())
                last["job/restarts"] = float(self.recovery.restarts)
                last["job/rollout_replacements"] = float(self.recovery.replaced)
                self.sink.metrics(self.step_index, last)
                self.completed_steps = self.step_index
                self.sink.progress(self.step_index, total, _headline(last))
                if self._due(self.spec.checkpoint.every) or self.control.checkpoint_now:
                    self.save_checkpoint()
                if self._target_reached(last):
                    break
                self._check_stop()
            self.finish()
            return last
        except Exception as err:
            lost = worker_lost(err, self.job.groups if self.job is not None else None)
            if lost is None:
                raise
            raise lost from err
        finally:
            self.source.stop()
            if self.job is not None:
                self.job.shutdown()
            elif pool is not None:  # removing it twice (start_groups did on its failure) is harmless
                pool.remove()

    def _recover(self, lost: WorkerLost) -> None:
        """Restart the job from its last checkpoint; RestartsExhausted past the budget."""
        folder = checkpoints.find_resume_folder(self.spec, self.workdir)
        resume = checkpoints.step_of(folder) if folder is not None else 0
        self.recovery.begin(lost, self.sink, self.step_index, resume, folder)
        self.sink.rewind(resume)  # the steps after it are recomputed: one metric row per step
        self.step_index = self.completed_steps = resume
        self._reset_kl()
        try:
            pool = self.recovery.wait(self.spec.resources, self.name, lambda: self.control.stop_reason)
        except ResourcePoolError as err:  # no room within restart_wait_s: a failed restart, the next one
            raise WorkerLost("could not be placed", str(err)) from err
        if self.control.stop_reason is not None:
            if pool is not None:
                pool.remove()
            raise StopRequested(self.control.stop_reason)
        self._placed = pool
        self.sink.attempt = self.recovery.attempt

    def step(self) -> dict[str, float]:
        """One RL step: the source's scored samples, log-probs, advantages, update, the weights back."""
        spec, actor, critic = self.spec, self.job.groups.actor, self.job.groups.critic
        self._timings = {}
        with self.timed("step"):
            batch, scores, metrics = self.source.next_batch()
            if step_math.needs_old_log_probs(spec, len(batch), self.asked_proximal):
                with self.timed("old_log_prob"):
                    batch = actor.compute_log_prob(batch)
            if needs_reference(spec):
                with self.timed("ref"):
                    batch = actor.compute_ref_log_prob(batch)
            if critic is not None:
                with self.timed("values"):
                    batch = critic.compute_values(batch)
            with self.timed("adv"):
                batch, adv_metrics = step_math.add_advantages(batch, scores, spec, self.kl.value)
            if critic is not None:
                with self.timed("update_critic"):
                    metrics.update(
                        critic.update_critic(
                            batch, spec.algorithm.vf_clip, spec.algorithm.loss_agg_mode, self._schedule()
                        )
                    )
            actor_batch, rejection = step_math.reject_mismatched(batch, spec.algorithm.rollout_correction)
            actor_batch = step_math.actor_inputs(spec, actor_batch)
            with self.timed("update_actor"):
                metrics.update(
                    actor.update_actor(actor_batch, spec.algorithm.policy_loss_config(), self._schedule())
                )
            metrics.update(rejection)  # its mismatch report covers the tokens the loss no longer sees
            with self.timed("sync"):
                sync_done = self.publisher.publish()
            # The step's own records are written while the ranks load the new weights.
            self._record_step(metrics, adv_metrics, batch, scores)
            with self.timed("sync"):
                metrics.update(self._synced(sync_done))
            metrics.update(self.source.stats())
        return self._finish_metrics(metrics, batch)

    def _record_step(
        self, metrics: dict[str, float], adv_metrics: dict[str, float], batch: Any, scores: Any
    ) -> None:
        spec = self.spec
        if spec.algorithm.kl_in_reward:
            self.kl.update(adv_metrics["actor/reward_kl_penalty"], len(batch))
        metrics.update(adv_metrics)
        metrics.update(step_math.batch_metrics(batch, scores, spec.rollout.response_budget))
        if spec.trainer.samples_per_step:
            self.sink.samples(
                self.step_index,
                step_samples(batch, scores, self.job.tokenizer, spec.trainer.samples_per_step),
            )

    def sft_step(self) -> dict[str, float]:
        """One supervised step on prompt/response pairs, then a sync so validation sees it."""
        actor = self.job.groups.actor
        self._timings = {}
        with self.timed("step"):
            batch = next(self.job.loader)
            with self.timed("update_actor"):
                metrics = actor.update_sft(batch, self.spec.algorithm.loss_agg_mode, self._schedule())
            with self.timed("sync"):
                metrics.update(self._synced(actor.sync_weights))
        return self._finish_metrics(metrics, batch)

    def validate(self) -> dict[str, float]:
        """val/score/mean and val/accuracy on the validation prompts (trainer.val_greedy), over the rows
        that scored (step_math.validation_metrics)."""
        if self.job.val_batch is None:
            return {}
        with self.timed("validate"):
            with self.publisher.exclusive(VALIDATION_WAIT_S):  # async: the lanes wait, as in sync
                batch = self.generate(self.job.val_batch)
            batch, scores, metrics = self.job.rewards(batch)
        out = {f"val/{k}": v for k, v in metrics.items()}
        out.update(step_math.validation_metrics(batch, scores))
        accuracy = format_metric("val/accuracy", out.get("val/accuracy"))  # none: no row scored
        self.sink.event("validation", f"step {self.step_index}: val accuracy {accuracy}", **out)
        return out

    def generate(self, prompts: Any) -> Any:
        """The rollout role's responses; a split placement's lost rollout worker is replaced and the
        same prompts (same seeds) generated again (controller/recovery.py)."""
        try:
            return self.job.groups.actor.generate_sequences(prompts)
        except Exception as err:
            self._replace_rollout(err)
        return self.job.groups.actor.generate_sequences(prompts)

    def stop_while_waiting(self) -> None:
        """A stop arrived while the step waited for samples: stop at the previous step's boundary."""
        self.step_index -= 1
        self._check_stop()

    def _synced(self, wait: Callable[[], dict[str, float]]) -> dict[str, float]:
        """The sync's measurements; a rollout worker lost in it is replaced, whose transfer is the sync."""
        try:
            return wait()
        except Exception as err:
            return self._replace_rollout(err)

    def _replace_rollout(self, err: Exception) -> dict[str, float]:
        """Re-raises `err` unless a sync job's split rollout worker was lost alone. An async job restarts
        from its checkpoint instead: the replacement forms the whole rollout group anew, so the other
        lanes' calls in flight die with it and their draws (and the buffer's weight version, which the
        new workers lack until a sync) would need rewinding; the checkpoint regenerates them exactly."""
        if self.spec.trainer.mode == "async":
            raise err
        return self.recovery.replace_rollout(err, self.job.groups, self.sink, self.step_index)

    def state_dict(self) -> dict[str, Any]:
        state = {"step": self.step_index, "loader": self.job.loader.state_dict(), "kl_coef": self.kl.value}
        state.update(self.source.state_dict(state["loader"]))  # async: the oldest draw not trained
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step_index = self.completed_steps = int(state["step"])
        self.job.loader.load_state_dict(state["loader"])
        self.kl.value = state["kl_coef"]
        self.source.load_state_dict(state)

    def save_checkpoint(self) -> Path:
        self.control.checkpoint_now = False
        folder = checkpoints.save(
            self.workdir,
            self.step_index,
            self.job.groups,
            self.state_dict(),
            self.spec.checkpoint.keep_last,
            before_commit=self.sink.flush,  # never a checkpoint ahead of the job's stored record
        )
        self.sink.event("checkpoint", f"saved step {self.step_index}", path=str(folder), step=self.step_index)
        return folder

    def _resume(self) -> None:
        folder = checkpoints.find_resume_folder(self.spec, self.workdir)
        if folder is not None:
            self.load_state_dict(checkpoints.load(folder, self.job.groups))
            # The spec's learning rates win: an edit made while paused, or a fork's.
            self._send_learning_rates(("lr", "critic_lr"))
            self.sink.event(
                "resumed", f"resumed from step {self.step_index}", path=str(folder), step=self.step_index
            )

    def finish(self) -> None:
        if self.spec.checkpoint.every == 0 or not self._due(self.spec.checkpoint.every):
            self.save_checkpoint()
        if self.spec.checkpoint.export_hf:
            export = self.workdir / "export"
            self.job.groups.actor.export_hf(str(export), self.spec.checkpoint.export_merged)
            what = "PEFT adapter" if self.spec.model.lora is not None else "HF model"
            self.sink.event("exported", f"{what} written to {export}", path=str(export))

    def _schedule(self) -> UpdateSchedule:
        return self.spec.algorithm.update_schedule(seed=self.step_index)

    def _due(self, every: int) -> bool:
        return every > 0 and self.step_index % every == 0

    def _target_reached(self, metrics: dict[str, float]) -> bool:
        target, accuracy = self.spec.trainer.stop_at_val_accuracy, metrics.get("val/accuracy")
        if target is None or accuracy is None or accuracy < target:
            return False
        self.sink.event(
            "target_reached",
            f"step {self.step_index}: val accuracy {accuracy:.3f} >= {target}: finishing early",
            step=self.step_index,
            accuracy=accuracy,
        )
        return True

    def _check_stop(self) -> None:
        reason = self.control.stop_reason
        if reason is None or self.step_index >= self.spec.trainer.total_steps:
            return
        if reason == "pause" and not self._due(self.spec.checkpoint.every):
            self.save_checkpoint()
        raise StopRequested(reason)

    def _apply_hyperparameters(self) -> None:
        changes = self.control.take_hyperparameters()
        if changes:
            self.spec = self.job.spec = self.spec.merged(hyperparameter_overrides(changes))
            self._send_learning_rates(changes)
            if "kl_reward_coef" in changes:
                self._reset_kl()
            self.sink.event("hyperparameters", f"applied at step {self.step_index + 1}: {changes}", **changes)

    def _send_learning_rates(self, names: Collection[str]) -> None:
        """The spec's learning rates among `names` to the workers now (the schedule's factor applies)."""
        actor, critic = self.job.groups.actor, self.job.groups.critic
        if "lr" in names:
            actor.set_hyperparameters(lr=self.spec.optim.lr)
        if "critic_lr" in names and critic is not None:
            critic.set_hyperparameters(lr=self.spec.algorithm.critic_lr)

    def _reset_kl(self) -> None:
        self.kl = KLController(self.spec.algorithm.kl_reward_coef, self.spec.algorithm.kl_target)

    @contextmanager
    def timed(self, phase: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self._timings[phase] = self._timings.get(phase, 0.0) + time.perf_counter() - start

    def _finish_metrics(self, metrics: dict[str, float], batch: Any) -> dict[str, float]:
        metrics.update({f"timing_s/{k}": v for k, v in self._timings.items()})
        tokens = float(batch.tensors["attention_mask"].sum())
        metrics["perf/total_num_tokens"] = tokens
        metrics["perf/throughput"] = tokens / max(self._timings.get("step", 0.0), 1e-9)
        if self.spec.trainer.mode == "async":  # the step's time not spent waiting for samples
            busy = self._timings.get("step", 0.0) - self._timings.get("wait_rollout", 0.0)
            metrics["perf/trainer_tokens_per_s"] = tokens / max(busy, 1e-9)
        metrics["training/step"] = float(self.step_index)
        metrics["training/epoch"] = float(self.job.loader.epoch)
        return metrics


def _headline(metrics: dict[str, float]) -> dict[str, float]:
    keys = ("critic/score/mean", "sft/loss", "val/accuracy", "timing_s/step")
    return {k: metrics[k] for k in keys if k in metrics}
