"""The scheduler: one background thread that runs each job in its own controller actor.

Every `poll_s` it copies what running jobs produced (events, metrics, logs, checkpoints) into the
store, settles jobs whose run ended, and starts queued jobs while the cluster has room for them (a
job needs each role's workers x its per-worker CPUs and GPUs, controller/role_shares.py). Queued jobs go in fair order between
owners (`fair_order`): one owner's ten queued jobs do not starve another's one. An owner at its
quota of running jobs, CPUs or GPUs (service/quotas.py) is passed over until one of its jobs
ends. Requests never wait on it: the Service changes the store and calls `tell` or `stop`, which only
send a message.

A hosted record (a Tinker training run, service/workloads.py) is queued, scheduled and counted the
same way, but a launch hands it to the process that serves it (its base model's session host), and
it holds its slot until that server ends it (`end`); a request may start it at once (`admit`), so a
client need not wait for the next poll. The hosts themselves hold CPUs while they run (`hold`): RL
jobs are scheduled around them.

A job that starts again after a crash resumes from its last complete checkpoint: at launch the
store forgets the metrics recorded after that step, so the re-run steps are stored once. A job whose
controller restarts its workers (controller/recovery.py) says so in its drain: the step it went back
to (the store forgets the later metrics the same way) and the restart under way, which the job's
API view shows until it resumed.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray

from service.controller_pool import ControllerPool
from service.files import FileError, FileStore
from service.job_state import RUN_HOLDING, TERMINAL, JobStatus, allowed
from service.keys import ADMIN_OWNER
from service.owned_paths import OwnedPaths, PathRefused
from service.quotas import QuotaBook, Usage, fair_order, may_run
from service.store import JobRecord, JobStore
from service.tracker_policy import TrackerRefused
from service.workloads import RL_JOB, TinkerRunWorkload, Workload, resume_step

log = logging.getLogger("tandem.scheduler")
S = JobStatus


@dataclass
class RunningJob:
    actor: Any  # None for a hosted record: its server runs it
    run_ref: Any
    cpus: float
    gpus: float
    first_step: int  # the step it resumed from: until it passes it, the job is starting up
    owner: str = "admin"
    killed_for: str | None = None  # "cancel" when stopped by killing its actor during start-up


class Scheduler:
    def __init__(
        self,
        store: JobStore,
        poll_s: float = 0.3,
        runtime_env: dict | None = None,
        files: FileStore | None = None,
        quotas: QuotaBook | None = None,
        workload: Workload = RL_JOB,
        warm_controllers: int = 1,
    ) -> None:
        self.store = store
        self.workload = workload  # what the jobs table holds
        self.hosted: dict[str, Any] = {"tinker": TinkerRunWorkload()}  # kinds with a table of their own
        self.held: dict[str, tuple[float, float]] = {}  # CPUs and GPUs of the processes serving them
        self.files = files
        self.paths: OwnedPaths | None = None  # set by the API (api/app.py), which knows the shared folders
        self.quotas = quotas or QuotaBook()
        self.poll_s = poll_s
        self.runtime_env = runtime_env
        options: dict[str, Any] = {"num_cpus": 0, "max_concurrency": 8}
        if runtime_env:
            options["runtime_env"] = runtime_env
        # Controllers that imported the runner's module before a job needs one (service/controller_pool.py)
        self.controllers = ControllerPool(workload.runner, warm_controllers, options)
        self.running: dict[str, RunningJob] = {}
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._requeue_on_pause: set[str] = set()  # jobs paused by a service shutdown, not by a user
        self._paused_for_shutdown: list[str] = []  # the shutdown's log line lists them
        self._draining = False
        self._asked_autoscaler = False
        self._served: dict[str, int] = {}  # owner -> the number of its latest start (fair_order)
        self._told_waiting: str | None = None  # the job waiting for room that was told why
        self._starts = 0

    # ---- lifecycle -----------------------------------------------------------------------------

    @property
    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stop.is_set()

    def start(self) -> None:
        self._recover()
        self.controllers.fill()
        self._thread = threading.Thread(target=self._loop, name="tandem-scheduler", daemon=True)
        self._thread.start()

    def workload_of(self, record: JobRecord) -> Any:
        return self.hosted.get(record.method, self.workload)

    def _recover(self) -> None:
        for job in self.store.jobs_in((S.QUEUED, S.RUNNING, S.PAUSING)):
            if job.method in self.hosted:  # its server went with the old service
                self.end(job.id, *self.hosted[job.method].recover(job))
                continue
            if job.status == S.QUEUED:
                continue
            self.store.transition(job.id, (S.RUNNING, S.PAUSING), S.QUEUED)
            self.store.set_restart(job.id, None)  # a restart under way ended with the service
            self.store.truncate_after(
                job.id, resume_step(self.workload, job.workdir)
            )  # shown at its checkpoint until it runs
            self._record_checkpoints_on_disk(job)
            self.store.add_event(
                job.id, "requeued", "the service restarted; the job resumes from its last checkpoint"
            )
        for job in self.store.jobs_in((S.CANCELLING,)):
            self.store.transition(job.id, (S.CANCELLING,), S.CANCELLED, finished_at=time.time())
            self.store.add_event(job.id, "cancelled", "cancelled while the service was down")

    def _record_checkpoints_on_disk(self, job: JobRecord) -> None:
        """A checkpoint committed just before the service died may not be in the store yet."""
        known = {c["step"] for c in self.store.checkpoints(job.id)}
        for step, folder in self.workload.committed_checkpoints(Path(job.workdir)):
            if step not in known:
                self.store.add_checkpoint(job.id, step, str(folder))
                self.store.add_event(
                    job.id, "checkpoint", f"saved step {step}", {"path": str(folder), "step": step}
                )

    def shutdown(self, timeout_s: float = 120.0) -> None:
        """Pause every running job (each checkpoints at its next step boundary), then stop."""
        self._draining = True  # start nothing new; the loop keeps collecting until the jobs paused
        for kind in self.hosted.values():
            if kind.server is not None:
                kind.server.shutdown()  # its runs stay `running` until the next start recovers them
        with self._lock:
            for job_id in [i for i, run in self.running.items() if run.actor is None]:
                del self.running[job_id]
            for job_id, run in self.running.items():
                if self.store.transition(job_id, (S.RUNNING,), S.PAUSING):
                    self._requeue_on_pause.add(job_id)
                    self.store.add_event(
                        job_id, "service_shutdown", "the service is stopping: checkpointing the job"
                    )
                    run.actor.request_stop.remote("pause")
        deadline = time.time() + timeout_s
        while self.running and time.time() < deadline:
            time.sleep(self.poll_s)
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        with self._lock:
            if self._paused_for_shutdown:
                log.info("paused for the shutdown, each resumes from its checkpoint when the service starts: %s",
                         ", ".join(self._paused_for_shutdown))  # fmt: skip
            for job_id, run in list(self.running.items()):
                ray.kill(run.actor, no_restart=True)
                if self.store.transition(job_id, (S.CANCELLING,), S.CANCELLED, finished_at=time.time()):
                    self.store.add_event(job_id, "cancelled", "cancelled: the service stopped")
                elif self.store.transition(job_id, (S.RUNNING, S.PAUSING), S.QUEUED):
                    self.store.add_event(
                        job_id, "requeued", "the service stopped before the job paused; it resumes later"
                    )
            self.running.clear()
        self.controllers.close()

    # ---- messages from requests ----------------------------------------------------------------

    def tell(self, job_id: str, method: str, *args: Any) -> None:
        """Send a message to the job's controller actor, if it runs (never waits for an answer)."""
        with self._lock:
            run = self.running.get(job_id)
        if run is not None and run.actor is not None:
            getattr(run.actor, method).remote(*args)

    def controller(self, job_id: str) -> Any:
        """The running job's controller actor (None when it does not run)."""
        with self._lock:
            run = self.running.get(job_id)
        return run.actor if run is not None else None

    def stop(self, job_id: str, reason: str) -> None:
        """Ask a running job to stop ("pause" or "cancel") at its next step boundary. A job cancelled
        while it is still starting up has nothing to keep: its actor is killed at once. A hosted
        record's server drops it at once."""
        record = self.store.get_job(job_id)
        if record is not None and record.method in self.hosted:
            self.hosted[record.method].stop(job_id)
            self.end(
                job_id, S.CANCELLED, "cancelled through Tandem's API (tandem cancel); its checkpoints stay"
            )
            return
        with self._lock:
            run = self.running.get(job_id)
            if run is None:
                return
            starting = self.store_step(job_id) <= run.first_step
            if reason == "cancel" and starting:
                run.killed_for = "cancel"
                ray.kill(run.actor, no_restart=True)  # its worker actors and placement group go with it
                return
        run.actor.request_stop.remote(reason)

    def store_step(self, job_id: str) -> int:
        job = self.store.get_job(job_id)
        return job.step if job is not None else 0

    # ---- the loop ------------------------------------------------------------------------------

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self._collect()
                self._schedule()
                self._warm_up()
            except Exception:  # the loop must survive anything a job does
                log.exception("scheduler iteration failed")
            self._stop.wait(self.poll_s)

    def _warm_up(self) -> None:
        """Start the warm controllers the pool lacks, while no job is starting up: a controller's
        imports take ~7 s of a core, which a starting job's own processes need on a small machine."""
        if self._draining:
            return
        with self._lock:
            runs = list(self.running.items())
        if all(self.store_step(job_id) > run.first_step for job_id, run in runs):
            self.controllers.fill()

    def free(self) -> tuple[float, float]:
        total = ray.cluster_resources() if ray.is_initialized() else {}
        with self._lock:
            held = [(r.cpus, r.gpus) for r in self.running.values()] + list(self.held.values())
        return total.get("CPU", 0) - sum(c for c, _ in held), total.get("GPU", 0) - sum(g for _, g in held)

    def hold(self, key: str, cpus: float, gpus: float = 0.0) -> None:
        """Count a process that serves hosted records (a session host) as holding these resources."""
        with self._lock:
            self.held[key] = (cpus, gpus)

    def release(self, key: str) -> None:
        with self._lock:
            self.held.pop(key, None)

    def _schedule(self) -> None:
        if self._draining:
            return
        used = self.owner_usage()
        running = {o: u.running_jobs for o, u in used.items()}
        for job in fair_order(self.store.jobs_in((S.QUEUED,)), running, self._served):
            if self._try_start(job, used) == "room":
                self._say_waiting(job)
                self._ask_autoscaler(job)
                return  # strict order: no later job jumps the one that waits for room
        self._told_waiting = None
        if self._asked_autoscaler:  # nothing waits any more: withdraw the request
            self._ask_autoscaler(None)

    def _say_waiting(self, job: JobRecord) -> None:
        """Tell a job that waits for room (once) what it needs and what holds the rest: a session host
        holds its CPUs for as long as the service runs, so a job may wait for a restart."""
        if self._told_waiting == job.id:
            return
        self._told_waiting = job.id
        needs, (free_cpus, free_gpus) = self.workload_of(job).needs(job.spec), self.free()
        with self._lock:
            holders = [*self.held.items(), *((key, (r.cpus, r.gpus)) for key, r in self.running.items())]
        held = ", ".join(f"{key}: {c:g} CPUs, {g:g} GPUs" for key, (c, g) in holders if c or g)
        message = (f"waiting for room: it needs {needs.cpus:g} CPUs and {needs.gpus:g} GPUs; {free_cpus:g} CPUs "
                   f"and {free_gpus:g} GPUs are free (held by {held or 'nothing'})")  # fmt: skip
        self.store.add_event(job.id, "waiting", message, {"free_cpus": free_cpus, "free_gpus": free_gpus})

    def admit(self, record_id: str) -> bool:
        """Start a queued record now if its owner's quota and the cluster allow (a request that made
        it need not wait for the next poll); else it waits in the queue. True when it started."""
        record = self.store.get_job(record_id)
        return (
            record is not None
            and not self._draining
            and self._try_start(record, self.owner_usage()) == "started"
        )

    def _try_start(self, job: JobRecord, used: defaultdict[str, Usage]) -> str:
        """Launch `job` if its owner's quota and the free room allow: "started", "quota" or "room"."""
        needs = self.workload_of(job).needs(job.spec)
        cpus, gpus = needs.cpus, needs.gpus
        with self._lock:  # one start at a time: the loop and a request's `admit` see each other's
            if not may_run(self.quotas.of(job.owner), used[job.owner], cpus, gpus):
                return "quota"  # its owner is at its quota: the job waits, other owners' jobs go ahead
            free_cpu, free_gpu = self.free()
            if cpus > free_cpu + 1e-9 or gpus > free_gpu + 1e-9:
                return "room"
            self._launch(job, cpus, gpus)
            self._starts += 1
            self._served[job.owner] = self._starts
            mine = used[job.owner]
            mine.running_jobs, mine.cpus, mine.gpus = (
                mine.running_jobs + 1,
                mine.cpus + cpus,
                mine.gpus + gpus,
            )
        return "started"

    def owner_usage(self) -> defaultdict[str, Usage]:
        """Jobs, CPUs and GPUs each owner's running jobs hold now (what the quotas cap)."""
        used: defaultdict[str, Usage] = defaultdict(lambda: Usage(""))
        with self._lock:
            for run in self.running.values():
                mine = used[run.owner]
                mine.running_jobs, mine.cpus, mine.gpus = (
                    mine.running_jobs + 1,
                    mine.cpus + run.cpus,
                    mine.gpus + run.gpus,
                )
        return used

    def _ask_autoscaler(self, job: JobRecord | None) -> None:
        """Tell Ray's autoscaler (where there is one) what the waiting job needs, so nodes are added;
        None withdraws the request."""
        bundles = self.workload_of(job).needs(job.spec).bundles if job is not None else []
        self._asked_autoscaler = job is not None
        try:
            from ray.autoscaler.sdk import request_resources

            request_resources(bundles=bundles)
        except Exception:  # no autoscaler on a local cluster: nothing to ask
            log.debug("autoscaler request for %s not delivered", job.id if job else None, exc_info=True)

    def _launch(self, job: JobRecord, cpus: float, gpus: float) -> None:
        # Under the lock from the status change to the run's registration: a cancel or pause that
        # sees the job running also finds its actor to tell.
        with self._lock:
            if not self.store.transition(job.id, (S.QUEUED,), S.RUNNING, error=None):
                return
            self.store.started(job.id, time.time())
            if job.method in self.hosted:
                self.running[job.id] = RunningJob(None, None, cpus, gpus, -1, job.owner)
                self._launch_hosted(job)
                return
            first_step = resume_step(self.workload, job.workdir)
            try:  # upload ids -> stored paths and every path checked again, now that it starts
                spec = self.spec_to_run(job, first_step > 0)
            except (FileError, PathRefused, TrackerRefused) as err:
                self.store.transition(job.id, (S.RUNNING,), S.FAILED, finished_at=time.time(), error=str(err))
                self.store.add_event(job.id, "failed", str(err))
                return
            self.store.truncate_after(job.id, first_step)  # the trainer re-runs every step after it
            Path(job.workdir).mkdir(parents=True, exist_ok=True)
            restarts = self.store.count_events(job.id, "restart")  # the budget is the job's, not a run's
            actor = self.controllers.take()
            actor.begin.remote(job.id, spec, job.workdir, {"restarts": restarts})
            self.running[job.id] = RunningJob(actor, actor.run.remote(), cpus, gpus, first_step, job.owner)
        self.store.add_event(job.id, "started", f"running on {cpus:g} CPUs and {gpus:g} GPUs")

    def _launch_hosted(self, job: JobRecord) -> None:
        try:
            self.hosted[job.method].launch(job)
        except Exception as err:  # noqa: BLE001 - the record fails, naming why; the loop goes on
            self.end(job.id, S.FAILED, f"could not start: {type(err).__name__}: {err}")
            return
        self.store.add_event(job.id, "started", "served by its base model's session host")

    def end(self, record_id: str, status: JobStatus, why: str | None = None) -> bool:
        """A hosted record's run ended (its server says why): its status and an event, its slot free.
        True when its status changed."""
        sources = tuple(s for s in (S.QUEUED, *RUN_HOLDING) if allowed(s, status))
        done = {"finished_at": time.time()} if status in TERMINAL else {}
        moved = self.store.transition(record_id, sources, status, error=why, **done)
        if moved:
            self.store.add_event(record_id, status, why or str(status))
        with self._lock:
            self.running.pop(record_id, None)
        return moved

    def forget(self, record_id: str) -> None:
        """A hosted record its server refused to start leaves no trace: its slot and its rows go."""
        with self._lock:
            self.running.pop(record_id, None)
        if self.store.get_job(record_id) is not None:
            self.store.delete_job(record_id)

    def spec_to_run(self, job: JobRecord, own_checkpoint: bool) -> dict[str, Any]:
        """The job's spec as its run gets it: its owner's uploads by path, each path it names resolved
        and still the owner's to name (service/owned_paths.py)."""
        sees = None if job.owner == ADMIN_OWNER else job.owner
        spec = self.files.resolve_refs(job.spec, sees) if self.files else job.spec
        return self.paths.check_spec(spec, sees, own_checkpoint) if self.paths is not None else spec

    def _collect(self) -> None:
        with self._lock:
            items = list(self.running.items())
        for job_id, run in items:
            if run.run_ref is None:  # a hosted record: its server reports its end (`end`)
                continue
            done = bool(ray.wait([run.run_ref], timeout=0)[0])
            if run.killed_for is None:
                self._drain(job_id, run)
            if done:
                self._settle(job_id, run)

    def _drain(self, job_id: str, run: RunningJob) -> None:
        try:
            out = ray.get(run.actor.drain.remote(), timeout=30)
        except Exception:  # a dead actor is settled from its run result
            return
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
        status, now = result["status"], time.time()
        if status == S.PAUSED and job_id in self._requeue_on_pause:
            self._requeue_on_pause.discard(job_id)
            self._paused_for_shutdown.append(job_id)
            self.store.add_event(job_id, "paused", f"paused at step {result['step']}: the service is shutting down",
                                 {"reason": "service_shutdown", "step": result["step"]})  # fmt: skip
            self.store.transition(job_id, (S.PAUSING, S.RUNNING), S.QUEUED)
            self.store.add_event(
                job_id, "requeued", f"checkpointed at step {result['step']}; resumes when the service starts"
            )
        elif status == S.PAUSED:
            self.store.transition(job_id, (S.PAUSING, S.RUNNING), S.PAUSED)
            self.store.add_event(job_id, "paused", f"paused at step {result['step']}")
        elif status == S.FAILED and result.get("controller_lost") and self._requeue_lost(job_id, result):
            pass  # it waits in queued for room, then resumes from its last checkpoint
        elif status == S.FAILED:
            self.store.transition(job_id, RUN_HOLDING, S.FAILED, finished_at=now, error=result.get("error"))
            self.store.add_event(job_id, "failed", result.get("error") or "failed")
        else:  # succeeded, or cancelled at a step boundary or during start-up
            self.store.transition(job_id, RUN_HOLDING, S(status), finished_at=now)
            self.store.add_event(
                job_id, status, result.get("message") or f"{status} at step {result.get('step')}"
            )
        if self.store.get_job(job_id).status != S.QUEUED:
            self.store.set_restart(job_id, None)
        ray.kill(run.actor, no_restart=True)
        _remove_placement_group(f"{job_id}-pool")
        with self._lock:
            self.running.pop(job_id, None)

    def _requeue_lost(self, job_id: str, result: dict[str, Any]) -> bool:
        """A running job whose controller actor died (its process or node) goes back to queued, within
        trainer.max_restarts (shared with the restarts its controllers made: `restart` events)."""
        job = self.store.get_job(job_id)
        most = job.spec["trainer"].get("max_restarts", 3)
        n = self.store.count_events(job_id, "restart") + 1
        if self._draining or n > most or not self.store.transition(job_id, (S.RUNNING,), S.QUEUED):
            return False
        message, resume = (
            f"restarting ({n}/{most}): the job's controller died",
            resume_step(self.workload, job.workdir),
        )
        self.store.add_event(
            job_id,
            "restart",
            f"{message}; it waits in queued for room, then resumes from step {resume}: {result['error']}",
            {
                "cause": "controller died",
                "error": result["error"],
                "restart": n,
                "max_restarts": most,
                "attempt": n + 1,
                "step": job.step,
                "resume_step": resume,
            },  # fmt: skip
        )
        self.store.set_restart(
            job_id, {"message": message, "phase": "queued", "restart": n, "max_restarts": most}
        )
        return True

    def _result(self, run: RunningJob) -> dict[str, Any]:
        if run.killed_for == "cancel":
            return {"status": "cancelled", "message": "cancelled while it was starting up"}
        try:
            return ray.get(run.run_ref, timeout=30)
        except Exception as err:
            error = f"the job's controller died: {type(err).__name__}: {err}"
            return {"status": "failed", "error": error, "controller_lost": True}


def _remove_placement_group(name: str) -> None:
    """A job's placement group outlives a controller actor that was killed or died (its lifetime is
    the service's Ray driver): remove it, or its CPUs and GPUs stay held."""
    try:
        group = ray.util.get_placement_group(name)
    except ValueError:  # none by that name: the job removed it when it ended
        return
    ray.util.remove_placement_group(group)
