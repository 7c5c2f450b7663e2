"""The scheduler: one background thread that runs each job in its own controller actor.

Every `poll_s` it copies what running jobs produced into the store, settles ended runs
(service/scheduler_runs.py) and starts queued jobs, in fair order between owners and within their
quotas, while the cluster has room. Requests never wait on it: `tell` and `stop` only send a message.
A hosted record (a Tinker training run) is queued, admitted and counted as a job is, but a launch hands it
to the process that serves it, which ends it (`end`); those processes hold CPUs while they run (`hold`).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import ray

from schema.job import JobSpec
from schema.section import changed_values, with_values
from service.controller_pool import ControllerPool
from service.errors import ServiceError
from service.job_state import RUN_HOLDING, JobStatus, allowed
from service.keys import ADMIN_OWNER
from service.owned_paths import OwnedPaths
from service.quotas import QuotaBook, Usage, fair_order, may_run
from service.scheduler_runs import RunningJob, RunSettlement
from service.store import JobRecord, JobStore
from service.workloads import RL_JOB, Needs, TinkerRunWorkload

log = logging.getLogger("tandem.scheduler")
S = JobStatus


class Scheduler(RunSettlement):
    def __init__(
        self,
        store: JobStore,
        poll_s: float = 0.3,
        runtime_env: dict | None = None,
        quotas: QuotaBook | None = None,
        warm_controllers: int = 1,
    ) -> None:
        self.store = store
        self.workload = RL_JOB  # what the jobs table holds
        self.hosted: dict[str, Any] = {"tinker": TinkerRunWorkload()}  # kinds with a table of their own
        self.held: dict[str, float] = {}  # CPUs of the processes serving hosted records
        self.paths: OwnedPaths | None = None  # set by the API (api/app.py), which knows the shared folders
        self.quotas = quotas or QuotaBook()
        self.poll_s = poll_s
        options: dict[str, Any] = {"num_cpus": 0, "max_concurrency": 8}
        if runtime_env:
            options["runtime_env"] = runtime_env
        # Controllers that imported the runner's module before a job needs one (service/controller_pool.py)
        self.controllers = ControllerPool(RL_JOB.runner, warm_controllers, options)
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
        """At a service start: what the old service left queued, running or stopping."""
        for job in self.store.jobs_in((S.QUEUED, S.RUNNING, S.PAUSING)):
            if job.method in self.hosted:  # its server went with the old service
                self.end(job.id, *self.hosted[job.method].recover(job))
            elif job.status != S.QUEUED:
                self._requeue_after_restart(job)
        for job in self.store.jobs_in((S.CANCELLING,)):
            self.store.transition(job.id, (S.CANCELLING,), S.CANCELLED)
            self.store.add_event(job.id, "cancelled", "cancelled while the service was down")

    def shutdown(self, timeout_s: float = 120.0) -> None:
        """Pause every running job (each checkpoints at its next step boundary), then stop."""
        self._draining = True  # start nothing new; the loop keeps collecting until the jobs paused
        for kind in self.hosted.values():  # hosted records stay `running` until the next start recovers them
            if kind.server is not None:
                kind.server.shutdown()
        with self._lock:
            for record_id in [i for i, run in self.running.items() if run.actor is None]:
                del self.running[record_id]
            for job_id, run in self.running.items():
                why = ("service_shutdown", "the service is stopping: checkpointing the job")
                if self.store.transition(job_id, (S.RUNNING,), S.PAUSING, why):
                    self._requeue_on_pause.add(job_id)
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
                if not self.store.transition(
                    job_id, (S.CANCELLING,), S.CANCELLED, ("cancelled", "cancelled: the service stopped")
                ):
                    why = ("requeued", "the service stopped before the job paused; it resumes later")
                    self.store.transition(job_id, (S.RUNNING, S.PAUSING), S.QUEUED, why)
            self.running.clear()
        self.controllers.close()

    # ---- messages from requests ----------------------------------------------------------------

    def tell(self, job_id: str, method: str, *args: Any) -> None:
        """Send a message to the job's controller actor, if it runs (never waits for an answer)."""
        actor = self.controller(job_id)
        if actor is not None:
            getattr(actor, method).remote(*args)

    def controller(self, job_id: str) -> Any:
        """The running job's controller actor (None when it does not run)."""
        with self._lock:
            run = self.running.get(job_id)
        return run.actor if run is not None else None

    def stop(self, job_id: str, reason: str) -> None:
        """Ask a running job to stop ("pause" or "cancel") at its next step boundary; a job cancelled
        while it starts up has nothing to keep, so its actor is killed at once."""
        record = self.store.get_job(job_id)
        if record is not None and record.method in self.hosted:  # its server drops it at once
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
                for kind in self.hosted.values():
                    kind.tend()
                self._schedule()
                self._warm_up()
            except Exception:  # the loop must survive anything a job does
                log.exception("scheduler iteration failed")
            self._stop.wait(self.poll_s)

    def _warm_up(self) -> None:
        """Start the warm controllers the pool lacks while no job starts up: their imports would compete
        with a starting job's processes for the cores."""
        if self._draining:
            return
        with self._lock:
            runs = list(self.running.items())
        if all(self.store_step(job_id) > run.first_step for job_id, run in runs):
            self.controllers.fill()

    def free(self) -> tuple[float, float]:
        total = ray.cluster_resources() if ray.is_initialized() else {}
        with self._lock:
            cpus = sum(r.cpus for r in self.running.values()) + sum(self.held.values())
            gpus = sum(r.gpus for r in self.running.values())
        return total.get("CPU", 0) - cpus, total.get("GPU", 0) - gpus

    def _schedule(self) -> None:
        if self._draining:
            return
        used = self.owner_usage()
        running = {o: u.running_jobs for o, u in used.items()}
        known: dict[str, Needs] = {}  # needs ask Ray for the cluster's shape: once a pass per resources
        for job in fair_order(self.store.jobs_in((S.QUEUED,)), running, self._served):
            if self._try_start(job, used, known) == "room":
                self._say_waiting(job)
                self._ask_autoscaler(job)
                return  # strict order: no later job jumps the one that waits for room
        self._told_waiting = None
        if self._asked_autoscaler:  # nothing waits any more: withdraw the request
            self._ask_autoscaler(None)

    def _say_waiting(self, job: JobRecord) -> None:
        """Tell a job that waits for room (once) what it needs and what holds the rest."""
        if self._told_waiting == job.id:
            return
        self._told_waiting = job.id
        needs, (free_cpus, free_gpus) = self.workload_of(job).needs(job.spec), self.free()
        with self._lock:
            holders = [*((key, (c, 0.0)) for key, c in self.held.items()),
                       *((key, (r.cpus, r.gpus)) for key, r in self.running.items())]  # fmt: skip
        held = ", ".join(f"{key}: {c:g} CPUs, {g:g} GPUs" for key, (c, g) in holders if c or g)
        message = (f"waiting for room: it needs {needs.cpus:g} CPUs and {needs.gpus:g} GPUs; {free_cpus:g} CPUs "
                   f"and {free_gpus:g} GPUs are free (held by {held or 'nothing'})")  # fmt: skip
        self.store.add_event(job.id, "waiting", message, {"free_cpus": free_cpus, "free_gpus": free_gpus})

    def admit(self, record_id: str) -> bool:
        """Start a queued record now if its owner's quota and the cluster allow; True when it started."""
        record = self.store.get_job(record_id)
        return (
            record is not None
            and not self._draining
            and self._try_start(record, self.owner_usage()) == "started"
        )

    def _try_start(
        self, job: JobRecord, used: defaultdict[str, Usage], known: dict[str, Needs] | None = None
    ) -> str:
        """Launch `job` if its owner's quota and the free room allow: "started", "quota" or "room"
        (`known`: needs already worked out, by method and resources)."""
        key = f"{job.method} {json.dumps(job.spec.get('resources'), sort_keys=True)}"
        known = {} if known is None else known
        if key not in known:
            known[key] = self.workload_of(job).needs(job.spec)
        needs = known[key]
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
            used[job.owner].add_running(cpus, gpus)
        return "started"

    def owner_usage(self) -> defaultdict[str, Usage]:
        """Jobs, CPUs and GPUs each owner's running jobs hold now (what the quotas cap)."""
        used: defaultdict[str, Usage] = defaultdict(lambda: Usage(""))
        with self._lock:
            for run in self.running.values():
                used[run.owner].add_running(run.cpus, run.gpus)
        return used

    def _ask_autoscaler(self, job: JobRecord | None) -> None:
        """Ask Ray's autoscaler (where there is one) for what the waiting job needs; None withdraws it."""
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
            # its spec as it is now: a hyper-parameter edit may have come in since the loop read the queue
            job = self.store.get_job(job.id) or job
            self.store.started(job.id, time.time())
            if job.method in self.hosted:
                self._launch_hosted(job, cpus, gpus)
                return
            first_step = self.workload.resume_step(job.workdir)
            try:  # upload ids -> stored paths and every path checked again, now that it starts
                spec = self.spec_to_run(job, first_step > 0)
            except (ServiceError, ValueError) as err:  # a path refused, or a spec that no longer parses
                # from RUN_HOLDING: a cancel or pause may have come in since the job went running
                self.store.transition(job.id, RUN_HOLDING, S.FAILED, ("failed", str(err)), error=str(err))
                return
            self.store.truncate_after(job.id, first_step)  # the trainer re-runs every step after it
            Path(job.workdir).mkdir(parents=True, exist_ok=True)
            restarts = self.store.count_events(job.id, "restart")  # the budget is the job's, not a run's
            actor = self.controllers.take()
            actor.begin.remote(job.id, spec, job.workdir, {"restarts": restarts})
            self.running[job.id] = RunningJob(actor, actor.run.remote(), cpus, gpus, first_step, job.owner)
        self.store.add_event(job.id, "started", f"running on {cpus:g} CPUs and {gpus:g} GPUs")

    def spec_to_run(self, job: JobRecord, own_checkpoint: bool) -> JobSpec:
        """The job's spec as its run gets it: uploads by path, each path resolved and still the owner's
        to name (service/owned_paths.py); the resolved values replace checked ones, not parsed again."""
        if self.paths is None:  # no API: nothing names an upload or a path to check
            return job.job_spec
        sees = None if job.owner == ADMIN_OWNER else job.owner
        spec = self.paths.check_spec(self.paths.files.resolve_refs(job.spec, sees), sees, own_checkpoint)
        return with_values(job.job_spec, changed_values(job.spec, spec))

    # ---- hosted records ------------------------------------------------------------------------

    def _launch_hosted(self, record: JobRecord, cpus: float, gpus: float) -> None:
        self.running[record.id] = RunningJob(None, None, cpus, gpus, -1, record.owner)
        try:
            self.hosted[record.method].launch(record)
        except Exception as err:  # noqa: BLE001 - the record fails, naming why; the loop goes on
            self.end(record.id, S.FAILED, f"could not start: {type(err).__name__}: {err}")
            return
        self.store.add_event(record.id, "started", "served by its base model's session host")

    def hold(self, key: str, cpus: float) -> None:
        """Count a process that serves hosted records (a session host) as holding these CPUs."""
        with self._lock:
            self.held[key] = cpus

    def release(self, key: str) -> None:
        with self._lock:
            self.held.pop(key, None)

    def end(self, record_id: str, status: JobStatus, why: str | None = None) -> bool:
        """A hosted record's run ended (its server says why): its status and an event, its slot free.
        True when its status changed."""
        sources = tuple(s for s in (S.QUEUED, *RUN_HOLDING) if allowed(s, status))
        moved = self.store.transition(record_id, sources, status, (status, why or str(status)), error=why)
        with self._lock:
            self.running.pop(record_id, None)
        return moved

    def forget(self, record_id: str) -> None:
        """A hosted record its server refused to start leaves no trace: its slot and its rows go."""
        with self._lock:
            self.running.pop(record_id, None)
        if self.store.get_job(record_id) is not None:
            self.store.delete_job(record_id)
