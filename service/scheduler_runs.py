"""How a job's run reaches the store: what it produced while it ran (`_drain`), and its record when it
ended (`_settle`), or back to queued when the service stops or its controller died within its restart
budget. A job resumes from its last complete checkpoint, and the store forgets what was recorded after
that step, so re-run steps are stored once. A pass waits briefly for each drain (one not answered yet is
taken at a later pass, its records kept); a controller that answers none for CONTROLLER_SILENT_S is
hung: it is killed and its job handled as a controller's loss.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

import ray

from service.job_state import RUN_HOLDING, JobStatus
from service.store import JobRecord, JobStore
from service.workloads import BEGIN_WAIT_S, RLJobWorkload

S = JobStatus


@dataclass
class RunningJob:
    actor: Any  # None for a hosted record: its server runs it
    run_ref: Any
    cpus: float
    gpus: float
    first_step: int  # the step it resumed from: until it passes it, the job is starting up
    owner: str
    killed_for: str | None = None  # "cancel" when stopped by killing its actor during start-up
    drain_ref: Any = None  # a drain asked for and not taken yet
    answered_at: float = field(default_factory=time.monotonic)  # its last drain's answer


class RunSettlement:
    """Mixed into the Scheduler, whose store, running jobs, lock and shutdown state these share."""

    store: JobStore
    workload: RLJobWorkload
    running: dict[str, RunningJob]
    _lock: threading.RLock
    _draining: bool
    _requeue_on_pause: set[str]  # jobs paused by a service shutdown, not by a user
    _paused_for_shutdown: list[str]  # the shutdown's log line lists them
    DRAIN_WAIT_S = 2.0  # what a pass waits for one controller's drain
    LAST_DRAIN_WAIT_S = 30.0  # the drain after its run ended (its last records; the actor is killed next)
    # A controller that answered no drain for this long is hung (a drain during a slow `begin` answers
    # within BEGIN_WAIT_S).
    CONTROLLER_SILENT_S = BEGIN_WAIT_S + 300.0

    def _requeue_after_restart(self, job: JobRecord) -> None:
        """A job the old service left running resumes from its last checkpoint when it runs again."""
        self.store.transition(job.id, (S.RUNNING, S.PAUSING), S.QUEUED)
        self.store.set_restart(job.id, None)  # a restart under way ended with the service
        self.store.truncate_after(job.id, self.workload.resume_step(job.workdir))  # shown at its checkpoint
        self._record_checkpoints_on_disk(job)
        self.store.add_event(
            job.id, "requeued", "the service restarted; the job resumes from its last checkpoint"
        )

    def _record_checkpoints_on_disk(self, job: JobRecord) -> None:
        """A checkpoint committed just before the service died may not be in the store yet."""
        known = {c["step"] for c in self.store.checkpoints(job.id)}
        for step, folder in self.workload.committed_checkpoints(job.workdir):
            if step not in known:
                self.store.add_checkpoint(job.id, step, str(folder))
                self.store.add_event(
                    job.id, "checkpoint", f"saved step {step}", {"path": str(folder), "step": step}
                )

    def _collect(self) -> None:
        with self._lock:
            items = list(self.running.items())
        for job_id, run in items:
            if run.run_ref is None:  # a hosted record: its server reports its end (`end`)
                continue
            done = bool(ray.wait([run.run_ref], timeout=0)[0])
            if run.killed_for is None:
                self._drain(job_id, run, final=done)
            if done:
                self._settle(job_id, run)
            elif run.killed_for is None and time.monotonic() - run.answered_at > self.CONTROLLER_SILENT_S:
                run.killed_for = "silent"
                ray.kill(run.actor, no_restart=True)  # its run ends with an error: settled at the next pass

    def _drain(self, job_id: str, run: RunningJob, final: bool = False) -> None:
        """Store what the job produced since the last drain; `final` (its run ended): a drain asked
        before the end is followed by one more, for the last records."""
        for _ in range(2 if final else 1):
            if run.drain_ref is None:
                run.drain_ref = run.actor.drain.remote()
            wait_s = self.LAST_DRAIN_WAIT_S if final else self.DRAIN_WAIT_S
            if not ray.wait([run.drain_ref], timeout=wait_s)[0]:
                return
            ref, run.drain_ref, run.answered_at = run.drain_ref, None, time.monotonic()
            try:
                out = ray.get(ref, timeout=self.DRAIN_WAIT_S)
            except Exception:  # a dead actor is settled from its run result
                return
            self._store_drained(job_id, run, out)

    def _store_drained(self, job_id: str, run: RunningJob, out: dict[str, Any]) -> None:
        for at, kind, message, data in out["events"]:
            self.store.add_event(job_id, kind, message, data, at=at)
        if out.get("rewind") is not None:  # the job restarted from a checkpoint: later steps are re-run
            self.store.truncate_after(job_id, out["rewind"])
        for at, step, values in out["metrics"]:
            self.store.add_metrics(job_id, step, values, at=at)
        for at, step, rows in out["samples"]:
            self.store.add_samples(job_id, step, rows, at=at)
        for step, path in out["checkpoints"]:
            self.store.add_checkpoint(job_id, step, path)
        self.store.add_logs(job_id, out["logs"])
        self.store.bump_step(job_id, out["step"])
        self.store.set_restart(job_id, out.get("restart"))
        run.actor.committed.remote(out["seq"])  # the job may now commit a checkpoint past these records

    def _settle(self, job_id: str, run: RunningJob) -> None:
        result = self._result(run)
        status = result["status"]
        if status == S.PAUSED and job_id in self._requeue_on_pause:
            self._requeue_on_pause.discard(job_id)
            self._paused_for_shutdown.append(job_id)
            self.store.add_event(job_id, "paused", f"paused at step {result['step']}: the service is shutting down",
                                 {"reason": "service_shutdown", "step": result["step"]})  # fmt: skip
            self.store.transition(job_id, (S.PAUSING, S.RUNNING), S.QUEUED)
            self.store.add_event(
                job_id, "requeued", f"checkpointed at step {result['step']}; resumes when the service starts"
            )
        elif status == S.PAUSED and self.store.get_job(job_id).status == S.CANCELLING:
            # cancelled after its pause was asked for, but the run had paused already: its checkpoint stays
            self.store.transition(
                job_id,
                (S.CANCELLING,),
                S.CANCELLED,
                ("cancelled", f"cancelled at step {result['step']} (it had paused)"),
            )
        elif status == S.PAUSED:
            self.store.transition(job_id, (S.PAUSING, S.RUNNING), S.PAUSED)
            self.store.add_event(job_id, "paused", f"paused at step {result['step']}")
        elif status == S.FAILED and result.get("controller_lost") and self._requeue_lost(job_id, result):
            pass  # it waits in queued for room, then resumes from its last checkpoint
        elif status == S.FAILED:
            self.store.transition(job_id, RUN_HOLDING, S.FAILED, error=result.get("error"))
            self.store.add_event(job_id, "failed", result.get("error") or "failed")
        else:  # succeeded, or cancelled at a step boundary or during start-up
            self.store.transition(job_id, RUN_HOLDING, S(status))
            self.store.add_event(
                job_id, status, result.get("message") or f"{status} at step {result.get('step')}"
            )
        settled = self.store.get_job(job_id)  # None: deleted the moment it ended
        if settled is not None and settled.status != S.QUEUED:
            self.store.set_restart(job_id, None)
        ray.kill(run.actor, no_restart=True)
        _remove_placement_group(f"{job_id}-pool")
        with self._lock:
            self.running.pop(job_id, None)

    def _requeue_lost(self, job_id: str, result: dict[str, Any]) -> bool:
        """A job whose controller actor died goes back to queued, within trainer.max_restarts (shared
        with its controllers' own restarts: `restart` events)."""
        job = self.store.get_job(job_id)
        most = job.job_spec.trainer.max_restarts
        n = self.store.count_events(job_id, "restart") + 1
        if self._draining or n > most or not self.store.transition(job_id, (S.RUNNING,), S.QUEUED):
            return False
        message = f"restarting ({n}/{most}): the job's controller died"
        resume = self.workload.resume_step(job.workdir)
        why = f"{message}; it waits in queued for room, then resumes from step {resume}: {result['error']}"
        data = {"cause": "controller died", "error": result["error"], "restart": n, "max_restarts": most}
        self.store.add_event(
            job_id, "restart", why, data | {"attempt": n + 1, "step": job.step, "resume_step": resume}
        )
        restart = {"message": message, "phase": "queued", "restart": n, "max_restarts": most}
        self.store.set_restart(job_id, restart)
        return True

    def _result(self, run: RunningJob) -> dict[str, Any]:
        if run.killed_for == "cancel":
            return {"status": "cancelled", "message": "cancelled while it was starting up"}
        if run.killed_for == "silent":
            error = (f"the job's controller answered no drain for {self.CONTROLLER_SILENT_S:.0f} s "
                     f"(actor {run.actor._actor_id.hex()}): killed as hung")  # fmt: skip
            return {"status": "failed", "error": error, "controller_lost": True}
        try:
            return ray.get(run.run_ref, timeout=30)
        except Exception as err:
            error = f"the job's controller died: {type(err).__name__}: {err}"
            return {"status": "failed", "error": error, "controller_lost": True}


def _remove_placement_group(name: str) -> None:
    """A placement group outlives a controller actor that was killed or died: remove it, or its CPUs and
    GPUs stay held."""
    try:
        group = ray.util.get_placement_group(name)
    except ValueError:  # none by that name: the job removed it when it ended
        return
    ray.util.remove_placement_group(group)
