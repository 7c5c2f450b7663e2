"""The service core: the job store plus a scheduler that runs each job in its own controller actor.

One background thread (`_loop`) does all the steering: it starts queued jobs, oldest first, while
the cluster has room for them (a job needs `workers x cpus_per_worker` CPUs and its GPUs);
copies what running jobs produced (events, metrics, logs, checkpoints) into the store; and
settles jobs whose run ended. Requests from the API only change the store and send a message to
the job's actor, so no request waits on a job. On start, jobs that were running when the service
stopped are queued again and resume from their last checkpoint.

States: queued → running → succeeded | failed | cancelled; running → pausing → paused → queued
(resume); running → cancelling → cancelled; a queued or paused job is cancelled at once.
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray
from pydantic import ValidationError

from controller.job_actor import JobController
from controller.job_setup import hyperparameter_overrides
from controller.spec import JobSpec
from controller.store import ACTIVE, TERMINAL, JobRecord, JobStore

log = logging.getLogger("tandem.service")


class ServiceError(Exception):
    """A request the service refuses: `status` is the HTTP status, `param` the field at fault."""

    def __init__(
        self, message: str, status: int = 400, param: str | None = None, code: str | None = None
    ) -> None:
        super().__init__(message)
        self.status, self.param, self.code = status, param, code


@dataclass
class RunningJob:
    actor: Any
    run_ref: Any
    cpus: float
    gpus: float


def job_needs(spec: dict[str, Any]) -> tuple[float, float]:
    res = spec["resources"]
    return res["workers"] * res["cpus_per_worker"], res["workers"] * res["gpus_per_worker"]


class Service:
    def __init__(self, home: str | Path, poll_s: float = 0.3, runtime_env: dict | None = None) -> None:
        self.home = Path(home)
        self.jobs_root = self.home / "jobs"
        self.store = JobStore(self.home / "tandem.db")
        self.poll_s = poll_s
        self.runtime_env = runtime_env
        self.running: dict[str, RunningJob] = {}
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._requeue_on_pause: set[str] = set()  # jobs paused by a service shutdown, not by a user
        self._draining = False
        self._asked_autoscaler = False
        self.started_at = time.time()

    # ---- lifecycle -----------------------------------------------------------------------------

    @property
    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stop.is_set()

    def start(self) -> None:
        self._recover()
        self._thread = threading.Thread(target=self._loop, name="tandem-scheduler", daemon=True)
        self._thread.start()

    def _recover(self) -> None:
        for job in self.store.jobs_in(("running", "pausing")):
            self.store.transition(job.id, ("running", "pausing"), "queued")
            self.store.add_event(
                job.id, "requeued", "the service restarted; the job resumes from its last checkpoint"
            )
        for job in self.store.jobs_in(("cancelling",)):
            self.store.transition(job.id, ("cancelling",), "cancelled", finished_at=time.time())
            self.store.add_event(job.id, "cancelled", "cancelled while the service was down")

    def shutdown(self, timeout_s: float = 120.0) -> None:
        """Pause every running job (each checkpoints at its next step boundary), then stop."""
        self._draining = True  # start nothing new; the loop keeps collecting until the jobs paused
        with self._lock:
            for job_id, run in self.running.items():
                if self.store.transition(job_id, ("running",), "pausing"):
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
            for job_id, run in list(self.running.items()):
                ray.kill(run.actor, no_restart=True)
                self.store.transition(job_id, ACTIVE, "queued")
                self.store.add_event(
                    job_id, "requeued", "the service stopped before the job paused; it resumes later"
                )
            self.running.clear()

    # ---- requests ------------------------------------------------------------------------------

    def submit(self, spec: JobSpec, idempotency_key: str | None = None, request_hash: str | None = None,
               parent_id: str | None = None) -> tuple[JobRecord, bool]:  # fmt: skip
        """Queue a job; returns (job, created). The same idempotency key and body return the first job."""
        if idempotency_key:
            existing = self.store.job_by_idempotency_key(idempotency_key)
            if existing is not None:
                if existing.request_hash != request_hash:
                    raise ServiceError(
                        "this Idempotency-Key was used with a different request body", 409, "Idempotency-Key",
                        "idempotency_conflict",
                    )  # fmt: skip
                return existing, False
        self._check_fits_cluster(spec)
        job = self.store.create_job(
            spec.model_dump(mode="json"), self.jobs_root, idempotency_key, request_hash, parent_id
        )
        return job, True

    def _check_fits_cluster(self, spec: JobSpec) -> None:
        cpus, gpus = job_needs(spec.model_dump())
        total = ray.cluster_resources()
        if cpus > total.get("CPU", 0) or gpus > total.get("GPU", 0):
            raise ServiceError(
                f"the job needs {cpus:g} CPUs and {gpus:g} GPUs; the whole cluster has {total.get('CPU', 0):g} CPUs "
                f"and {total.get('GPU', 0):g} GPUs",
                400, "resources.workers", "insufficient_resources",
            )  # fmt: skip

    def get(self, job_id: str) -> JobRecord:
        job = self.store.get_job(job_id)
        if job is None:
            raise ServiceError(f"no job '{job_id}'", 404, "job_id", "not_found")
        return job

    def cancel(self, job_id: str) -> JobRecord:
        job = self.get(job_id)
        if self.store.transition(job_id, ("queued", "paused"), "cancelled", finished_at=time.time()):
            self.store.add_event(job_id, "cancelled", "cancelled before it ran again")
        elif self.store.transition(job_id, ("running", "pausing"), "cancelling"):
            self.store.add_event(
                job_id, "cancelling", "cancel requested: the job stops after its current step"
            )
            self._tell(job_id, "request_stop", "cancel")
        elif job.status not in ("cancelling",):
            raise ServiceError(f"job '{job_id}' is {job.status}: only an active or paused job can be cancelled", 409,
                               "job_id", "invalid_state")  # fmt: skip
        return self.get(job_id)

    def pause(self, job_id: str) -> JobRecord:
        job = self.get(job_id)
        if self.store.transition(job_id, ("queued",), "paused"):
            self.store.add_event(job_id, "paused", "paused before it started")
        elif self.store.transition(job_id, ("running",), "pausing"):
            self.store.add_event(
                job_id, "pausing", "pause requested: the job checkpoints after its current step"
            )
            self._tell(job_id, "request_stop", "pause")
        elif job.status not in ("pausing", "paused"):
            raise ServiceError(f"job '{job_id}' is {job.status}: only a queued or running job can be paused", 409,
                               "job_id", "invalid_state")  # fmt: skip
        return self.get(job_id)

    def resume(self, job_id: str) -> JobRecord:
        job = self.get(job_id)
        if not self.store.transition(job_id, ("paused",), "queued"):
            raise ServiceError(f"job '{job_id}' is {job.status}: only a paused job can be resumed", 409, "job_id",
                               "invalid_state")  # fmt: skip
        self.store.add_event(job_id, "resumed", "queued again; it continues from its last checkpoint")
        return self.get(job_id)

    def delete(self, job_id: str) -> None:
        job = self.get(job_id)
        if job.status not in TERMINAL:
            raise ServiceError(f"job '{job_id}' is {job.status}: cancel it before deleting it", 409, "job_id",
                               "invalid_state")  # fmt: skip
        self.store.delete_job(job_id)

    def set_hyperparameters(self, job_id: str, changes: dict[str, Any]) -> JobRecord:
        job = self.get(job_id)
        if job.status in TERMINAL:
            raise ServiceError(
                f"job '{job_id}' is {job.status}: it has no next step", 409, "job_id", "invalid_state"
            )
        try:
            overrides = hyperparameter_overrides(changes)
        except KeyError as err:
            raise ServiceError(
                str(err.args[0]), 400, next(iter(changes), None), "unknown_hyperparameter"
            ) from None
        spec = _validated_merge(job.spec, overrides)
        self.store.update_job(job_id, spec=spec.model_dump(mode="json"))
        self.store.add_event(
            job_id, "hyperparameters_requested", f"requested for the next step: {changes}", changes
        )
        self._tell(job_id, "set_hyperparameters", changes)
        return self.get(job_id)

    def checkpoint_now(self, job_id: str) -> None:
        job = self.get(job_id)
        if job.status != "running":
            raise ServiceError(f"job '{job_id}' is {job.status}: only a running job can checkpoint now", 409,
                               "job_id", "invalid_state")  # fmt: skip
        self._tell(job_id, "checkpoint_now")
        self.store.add_event(job_id, "checkpoint_requested", "a checkpoint is saved after the current step")

    def fork(self, job_id: str, step: int | None, overrides: dict[str, Any]) -> JobRecord:
        parent = self.get(job_id)
        saved = self.store.checkpoints(job_id)
        if not saved:
            raise ServiceError(
                f"job '{job_id}' has no checkpoint to fork from", 409, "job_id", "no_checkpoint"
            )
        chosen = saved[-1] if step is None else next((c for c in saved if c["step"] == step), None)
        if chosen is None:
            raise ServiceError(f"job '{job_id}' has no checkpoint at step {step}; it has {[c['step'] for c in saved]}",
                               404, "checkpoint_step", "not_found")  # fmt: skip
        try:
            snapshot = self._snapshot_checkpoint(Path(chosen["path"]))
        except FileNotFoundError:
            raise ServiceError(
                f"job '{job_id}' pruned its checkpoint at step {chosen['step']} just now; fork from a newer one",
                409, "checkpoint_step", "checkpoint_pruned",
            ) from None  # fmt: skip
        spec = _validated_merge(parent.spec, {**overrides, "checkpoint": {
            **overrides.get("checkpoint", {}), "resume_from": str(snapshot)}})  # fmt: skip
        job, _ = self.submit(spec, parent_id=job_id)
        self.store.add_event(
            job.id, "forked", f"forked from {job_id} at step {chosen['step']}", {"parent": job_id}
        )
        return job

    def _snapshot_checkpoint(self, folder: Path) -> Path:
        """A private copy (hard links where the file system allows) of a checkpoint to fork from:
        the parent keeps running and may prune the original before the child starts."""
        target = self.jobs_root / "fork-sources" / uuid.uuid4().hex[:12] / folder.name

        def link_or_copy(src: str, dst: str) -> None:
            try:
                os.link(src, dst)
            except OSError:
                shutil.copy2(src, dst)

        shutil.copytree(folder, target, copy_function=link_or_copy)
        return target

    def _tell(self, job_id: str, method: str, *args: Any) -> None:
        with self._lock:
            run = self.running.get(job_id)
        if run is not None:
            getattr(run.actor, method).remote(*args)

    # ---- the scheduler loop ------------------------------------------------------------------

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self._collect()
                self._schedule()
            except Exception:  # the loop must survive anything a job does
                log.exception("scheduler iteration failed")
            self._stop.wait(self.poll_s)

    def _free(self) -> tuple[float, float]:
        total = ray.cluster_resources()
        with self._lock:
            used_cpu = sum(r.cpus for r in self.running.values())
            used_gpu = sum(r.gpus for r in self.running.values())
        return total.get("CPU", 0) - used_cpu, total.get("GPU", 0) - used_gpu

    def _schedule(self) -> None:
        if self._draining:
            return
        for job in self.store.jobs_in(("queued",)):
            cpus, gpus = job_needs(job.spec)
            free_cpu, free_gpu = self._free()
            if cpus > free_cpu + 1e-9 or gpus > free_gpu + 1e-9:
                self._ask_autoscaler(job)
                return  # strict order: the oldest queued job goes first
            self._launch(job, cpus, gpus)
        if self._asked_autoscaler:  # nothing waits any more: withdraw the request
            self._ask_autoscaler(None)

    def _ask_autoscaler(self, job: JobRecord | None) -> None:
        """Tell Ray's autoscaler (where there is one) what the waiting job needs, so nodes are added;
        None withdraws the request."""
        bundles: list[dict[str, float]] = []
        if job is not None:
            res = job.spec["resources"]
            bundle = {"CPU": res["cpus_per_worker"]}
            if res["gpus_per_worker"]:
                bundle["GPU"] = res["gpus_per_worker"]
            bundles = [bundle] * res["workers"]
        self._asked_autoscaler = job is not None
        try:
            from ray.autoscaler.sdk import request_resources

            request_resources(bundles=bundles)
        except Exception:  # no autoscaler on a local cluster: nothing to ask
            log.debug("autoscaler request for %s not delivered", job.id, exc_info=True)

    def _launch(self, job: JobRecord, cpus: float, gpus: float) -> None:
        if not self.store.transition(job.id, ("queued",), "running", started_at=time.time(), error=None):
            return
        Path(job.workdir).mkdir(parents=True, exist_ok=True)
        options: dict[str, Any] = {"num_cpus": 0, "max_concurrency": 8, "name": f"tandem-{job.id}"}
        if self.runtime_env:
            options["runtime_env"] = self.runtime_env
        actor = ray.remote(JobController).options(**options).remote(job.id, job.spec, job.workdir)
        with self._lock:
            self.running[job.id] = RunningJob(actor, actor.run.remote(), cpus, gpus)
        self.store.add_event(job.id, "started", f"running on {cpus:g} CPUs and {gpus:g} GPUs")

    def _collect(self) -> None:
        with self._lock:
            items = list(self.running.items())
        for job_id, run in items:
            done = bool(ray.wait([run.run_ref], timeout=0)[0])
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
        for at, step, values in out["metrics"]:
            self.store.add_metrics(job_id, step, values, at=at)
        for step, path in out["checkpoints"]:
            self.store.add_checkpoint(job_id, step, path)
        self.store.add_logs(job_id, out["logs"])
        self.store.bump_step(job_id, out["step"])

    def _settle(self, job_id: str, run: RunningJob) -> None:
        try:
            result = ray.get(run.run_ref, timeout=30)
        except Exception as err:
            result = {"status": "failed", "error": f"the job's controller died: {type(err).__name__}: {err}"}
        status = result["status"]
        now = time.time()
        if status == "paused" and job_id in self._requeue_on_pause:
            self._requeue_on_pause.discard(job_id)
            self.store.transition(job_id, ("pausing", "running"), "queued")
            self.store.add_event(
                job_id, "requeued", f"checkpointed at step {result['step']}; resumes when the service starts"
            )
        elif status == "paused":
            self.store.transition(job_id, ("pausing", "running"), "paused")
            self.store.add_event(job_id, "paused", f"paused at step {result['step']}")
        elif status == "failed":
            self.store.transition(job_id, ACTIVE, "failed", finished_at=now, error=result.get("error"))
            self.store.add_event(job_id, "failed", result.get("error") or "failed")
        else:  # succeeded, or cancelled at a step boundary
            self.store.transition(job_id, ACTIVE, status, finished_at=now)
            self.store.add_event(job_id, status, f"{status} at step {result.get('step')}")
        ray.kill(run.actor, no_restart=True)
        with self._lock:
            self.running.pop(job_id, None)

    # ---- views ---------------------------------------------------------------------------------

    def cluster(self) -> dict[str, Any]:
        nodes = [
            {
                "node_id": n["NodeID"],
                "address": n["NodeManagerAddress"],
                "alive": n["Alive"],
                "cpus": n["Resources"].get("CPU", 0),
                "gpus": n["Resources"].get("GPU", 0),
            }
            for n in ray.nodes()
        ]
        total = ray.cluster_resources()
        free_cpu, free_gpu = self._free()
        counts = self.store.counts_by_status()
        return {
            "nodes": nodes,
            "cpus": {"total": total.get("CPU", 0), "free": free_cpu},
            "gpus": {"total": total.get("GPU", 0), "free": free_gpu},
            "jobs": {
                "running": counts.get("running", 0) + counts.get("pausing", 0) + counts.get("cancelling", 0),
                "queued": counts.get("queued", 0),
            },  # fmt: skip
        }

    def checkpoint_dirs(self, job_id: str) -> list[dict[str, Any]]:
        self.get(job_id)
        return self.store.checkpoints(job_id)


def _validated_merge(spec: dict[str, Any], overrides: dict[str, Any]) -> JobSpec:
    """The spec with nested overrides, validated; a bad value is a 422 naming the field."""
    try:
        return JobSpec.model_validate(spec).merged(overrides)
    except ValidationError as err:
        first = err.errors()[0]
        param = ".".join(str(p) for p in first["loc"]) or None
        raise ServiceError(
            f"{param}: {first['msg']}" if param else first["msg"], 422, param, "invalid_value"
        ) from None
