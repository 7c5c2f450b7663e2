"""The service's request side: what the API asks of jobs, checked against the job store.

Requests only change the store and send a message to the job's controller actor through the
Scheduler (service/scheduler.py), which runs the jobs; no request waits on a job. Status changes
follow the one table in service/job_state.py. A record of another workload kind (a Tinker training
run, service/workloads.py) takes the requests its kind lists in `actions`; others are a 409.
"""

from __future__ import annotations

import shutil
import threading
from pathlib import Path
from typing import Any

import ray
from pydantic import ValidationError

from controller.hyperparameters import HYPERPARAMETERS, hyperparameter_overrides
from controller.resource_pool import Share, job_shares
from schema.job import JobLabels, JobSpec
from service.errors import ServiceError, invalid_state, invalid_value
from service.files import FileStore
from service.forks import fork_point, fork_source, remove_fork_source, same_weights_shape, snapshot_checkpoint
from service.job_state import RUN_HOLDING, TERMINAL, JobStatus
from service.keys import ADMIN_OWNER
from service.quotas import QuotaBook, Usage, check_storage, check_submission, folder_bytes
from service.scheduler import Scheduler
from service.store import JobRecord, JobStore

S = JobStatus


class Service:
    def __init__(self, home: str | Path, poll_s: float = 0.3, runtime_env: dict | None = None,
                 quotas: QuotaBook | None = None, warm_controllers: int = 1) -> None:  # fmt: skip
        self.home = Path(home)
        self.jobs_root = self.home / "jobs"
        self.store = JobStore(self.home / "tandem.db")
        self.files = FileStore(self.home / "files")
        self.quotas = quotas or QuotaBook()
        self.scheduler = Scheduler(self.store, poll_s, runtime_env, self.quotas, warm_controllers)
        self._admit = threading.Lock()  # a quota check and the row it admits, one request at a time
        self._edit = threading.Lock()  # a stored spec's read, change and write: two edits never lose one

    @property
    def is_alive(self) -> bool:
        return self.scheduler.is_alive

    def start(self) -> None:
        self.scheduler.start()

    def shutdown(self, timeout_s: float = 120.0) -> None:
        """Pause every running job (each checkpoints at its next step boundary), then stop."""
        self.scheduler.shutdown(timeout_s)

    # ---- requests ------------------------------------------------------------------------------

    def submit(self, spec: JobSpec, idempotency_key: str | None = None, request_hash: str | None = None,
               parent_id: str | None = None, owner: str = ADMIN_OWNER) -> tuple[JobRecord, bool]:  # fmt: skip
        """Queue a job for `owner`; returns (job, created). The same idempotency key and body return the
        first job. Idempotency keys are per owner: another owner's same key is another request."""
        with self._admit:  # the key's first use and its job's row in one step: no twin on a race
            if idempotency_key:
                existing = self.store.job_by_idempotency_key(owner, idempotency_key)
                if existing is not None:
                    if existing.request_hash != request_hash:
                        raise ServiceError(
                            "this Idempotency-Key was used with a different request body", 409,
                            "Idempotency-Key", "idempotency_conflict",
                        )  # fmt: skip
                    return existing, False
            needs = self.scheduler.workload.needs(spec.model_dump())
            self.check_quota(owner, needs.cpus, needs.gpus)
            self.check_fits_cluster(spec)
            job = self.store.create_job(spec, self.jobs_root, idempotency_key, request_hash, parent_id, owner)
        return job, True

    def admitting(self) -> threading.Lock:
        """Held from a quota check to the row it admits (a Tinker run's too): no two pass on a race."""
        return self._admit

    def check_quota(self, owner: str, cpus: float = 0.0, gpus: float = 0.0) -> None:
        """Refuse one more queued job of `owner` (needing `cpus` and `gpus` to run) beyond its quota
        (429 or 403, naming the quota)."""
        check_submission(self.quotas.of(owner), self.usage(owner), cpus, gpus)

    def usage(self, owner: str) -> Usage:
        """What `owner` uses now, read from the store and the disk on each call: quotas are checked
        against what is, not a counter that could drift. A Tinker run counts as a job."""
        usage, seen = Usage(owner), set[tuple[int, int]]()  # a fork's copy shares its parent's inodes
        for job in self.store.jobs_of(owner):
            if job.status == S.QUEUED:
                usage.queued_jobs += 1
            elif job.status in RUN_HOLDING:
                needs = self.scheduler.workload_of(job).needs(job.spec)
                usage.add_running(needs.cpus, needs.gpus)
            copy = fork_source(self.jobs_root, job.spec.get("checkpoint", {}).get("resume_from"))
            for folder in (Path(job.workdir, "checkpoints"), copy):
                usage.stored["checkpoints"] += folder_bytes(folder, seen) if folder else 0
            usage.stored["exports"] += folder_bytes(Path(job.workdir, "export"), seen)
        usage.stored["files"] = sum(r.bytes for r in self.files.records(owner))
        return usage

    def owners(self) -> list[str]:
        """Every owner with a key, a job or a file."""
        files = {r.owner for r in self.files.records()}
        return sorted(set(self.store.key_owners()) | set(self.store.job_owners()) | files)

    def check_storage(self, owner: str, adding: int = 0) -> None:
        """Refuse an upload of `adding` bytes beyond the owner's stored bytes (403)."""
        check_storage(self.quotas.of(owner), self.usage(owner), adding)

    def storage_left(self, owner: str) -> int | None:
        """Bytes `owner` may still store (None: no limit)."""
        limit = self.quotas.of(owner).stored_bytes
        return None if limit is None else limit - self.usage(owner).stored_bytes

    def check_fits_cluster(self, spec: JobSpec) -> None:
        """A job the cluster could never hold is refused now, not left queued or failed in Ray later."""
        needs = self.scheduler.workload.needs(spec.model_dump())
        cpus, gpus = needs.cpus, needs.gpus
        total = ray.cluster_resources()
        if cpus > total.get("CPU", 0) or gpus > total.get("GPU", 0):
            hint = _gpu_hint(spec, gpus, total.get("GPU", 0))
            raise ServiceError(
                f"resources: the job needs {cpus:g} CPUs and {gpus:g} GPUs (workers x per-worker); the whole "
                f"cluster has {total.get('CPU', 0):g} CPUs and {total.get('GPU', 0):g} GPUs{hint}",
                422, "resources", "insufficient_resources",
            )  # fmt: skip
        largest = max((n["Resources"].get("CPU", 0) for n in ray.nodes() if n["Alive"]), default=0)
        rollout = spec.resources.rollout_workers
        for field, per_worker in (
            ("resources.cpus_per_worker", spec.resources.cpus_per_worker),
            ("resources.rollout.cpus_per_worker", rollout.cpus_per_worker if rollout else None),
        ):
            if per_worker is not None and per_worker > largest:
                raise ServiceError(
                    f"{field}: {per_worker:g} CPUs; the largest node has {largest:g}",
                    422, field, "insufficient_resources",
                )  # fmt: skip
        nodes = [n["Resources"] for n in ray.nodes() if n["Alive"]]
        for role, share in job_shares(spec.resources).items():
            _check_strict_placement(spec.resources.placement_strategy, role, share, nodes)

    def get(self, job_id: str, sees: str | None = None) -> JobRecord:
        """The job, when `sees` (the caller's owner; None for an admin) may see it; else a 404 that does
        not say whether it exists."""
        job = self.store.get_job(job_id)
        if job is None or (sees is not None and job.owner != sees):
            raise ServiceError(f"no job '{job_id}'", 404, "job_id", "not_found")
        return job

    def steered(self, job_id: str, sees: str | None, action: str) -> JobRecord:
        """The job, if `action` is a request its workload kind takes; else a 409 naming what does."""
        job = self.get(job_id, sees)
        kind = self.scheduler.workload_of(job)
        if action not in kind.actions:
            raise ServiceError(f"job '{job.id}' is {kind.refusal}; only {', '.join(sorted(kind.actions))} apply",
                               409, "job_id", "invalid_state")  # fmt: skip
        return job

    def cancel(self, job_id: str, sees: str | None = None) -> JobRecord:
        job = self.get(job_id, sees)
        stopping = ("cancelling", "cancel requested: the job stops after its current step")
        if self.store.transition(
            job_id, (S.QUEUED, S.PAUSED), S.CANCELLED, ("cancelled", "cancelled before it ran again")
        ) or self.store.transition(job_id, (S.RUNNING, S.PAUSING), S.CANCELLING, stopping):
            self.scheduler.stop(job_id, "cancel")  # a hosted record's server forgets it
        elif (job := self.get(job_id, sees)).status != S.CANCELLING:  # as it is now, after a racing request
            raise invalid_state(job, "only an active or paused job can be cancelled")
        return self.get(job_id, sees)

    def pause(self, job_id: str, sees: str | None = None) -> JobRecord:
        job = self.steered(job_id, sees, "pause")
        pausing = ("pausing", "pause requested: the job checkpoints after its current step")
        if self.store.transition(job_id, (S.QUEUED,), S.PAUSED, ("paused", "paused before it started")):
            return self.get(job_id, sees)
        if self.store.transition(job_id, (S.RUNNING,), S.PAUSING, pausing):
            self.scheduler.stop(job_id, "pause")
        elif (job := self.get(job_id, sees)).status not in (S.PAUSING, S.PAUSED):
            raise invalid_state(job, "only a queued or running job can be paused")
        return self.get(job_id, sees)

    def resume(self, job_id: str, sees: str | None = None) -> JobRecord:
        job = self.steered(job_id, sees, "resume")
        with self._admit:
            if job.status == S.PAUSED:  # queued again: within the owner's queued jobs
                needs = self.scheduler.workload_of(job).needs(job.spec)
                self.check_quota(job.owner, needs.cpus, needs.gpus)
            if not self.store.transition(job_id, (S.PAUSED,), S.QUEUED):
                raise invalid_state(self.get(job_id, sees), "only a paused job can be resumed")
        self.store.add_event(job_id, "resumed", "queued again; it continues from its last checkpoint")
        return self.get(job_id, sees)

    def delete(self, job_id: str, sees: str | None = None) -> None:
        """Forget a finished job: its rows, its folder, and the checkpoint copy it was forked from."""
        job = self.get(job_id, sees)
        if job.status not in TERMINAL:
            raise invalid_state(job, "cancel it before deleting it")
        self.store.delete_job(job_id)
        shutil.rmtree(job.workdir, ignore_errors=True)
        remove_fork_source(self.jobs_root, job.spec.get("checkpoint", {}).get("resume_from"))

    def update_labels(self, job_id: str, labels: dict[str, Any], sees: str | None = None) -> JobRecord:
        """Change a job's name, tags or notes (any status); `labels` holds only the fields to change."""
        with self._edit:
            job = self.get(job_id, sees)
            current = {"name": job.name, "tags": job.tags, "notes": job.notes}
            try:
                merged = JobLabels.model_validate({**current, **labels})
            except ValidationError as err:
                raise invalid_value(err) from None
            changed = {k: v for k, v in merged.model_dump().items() if k in labels}
            self.store.update_job(job_id, **changed, spec={**job.spec, **changed})
        return self.get(job_id, sees)

    def set_hyperparameters(self, job_id: str, changes: dict[str, Any], sees: str | None = None) -> JobRecord:
        with self._edit:  # the stored spec and the controller's order of edits agree
            job = self.steered(job_id, sees, "hyperparameters")
            if job.status in TERMINAL:
                raise invalid_state(job, "it has no next step")
            try:
                overrides = hyperparameter_overrides(changes)
            except KeyError as err:
                unknown = next(name for name in changes if name not in HYPERPARAMETERS)
                raise ServiceError(str(err.args[0]), 400, unknown, "unknown_hyperparameter") from None
            spec = _validated_merge(job, overrides)
            self.store.update_job(job_id, spec=spec.model_dump(mode="json"))
            self.store.add_event(
                job_id, "hyperparameters_requested", f"requested for the next step: {changes}", changes
            )
            self.scheduler.tell(job_id, "set_hyperparameters", changes)
        return self.get(job_id, sees)

    def checkpoint_now(self, job_id: str, sees: str | None = None) -> None:
        job = self.steered(job_id, sees, "checkpoint")
        if job.status != S.RUNNING:
            raise invalid_state(job, "only a running job can checkpoint now")
        self.scheduler.tell(job_id, "checkpoint_now")
        self.store.add_event(job_id, "checkpoint_requested", "a checkpoint is saved after the current step")

    def merged_spec(self, job_id: str, overrides: dict[str, Any], sees: str | None = None) -> JobSpec:
        """The job's spec with `overrides` applied and validated (what a fork would run)."""
        parent = self.steered(job_id, sees, "fork")
        spec = _validated_merge(parent, overrides)
        same_weights_shape(parent.job_spec, spec)
        return spec

    def fork(self, job_id: str, step: int | None, spec: JobSpec, owner: str = ADMIN_OWNER) -> JobRecord:
        """A new job of `owner` (the forking key's) from one of the job's checkpoints; `spec` is the one
        `merged_spec` checked (the caller may see the job, and its kind forks)."""
        chosen = fork_point(self.store, job_id, step)
        if spec.trainer.total_steps <= chosen["step"]:
            raise ServiceError(
                f"trainer.total_steps = {spec.trainer.total_steps} leaves nothing to train after the checkpoint at "
                f"step {chosen['step']}: set trainer.total_steps above {chosen['step']} (`tandem fork --steps N`)", 422, "trainer.total_steps", "invalid_value",
            )  # fmt: skip
        try:
            snapshot = snapshot_checkpoint(self.jobs_root, Path(chosen["path"]))
        except FileNotFoundError:
            raise ServiceError(
                f"job '{job_id}' pruned its checkpoint at step {chosen['step']} just now; fork from a newer one",
                409, "checkpoint_step", "checkpoint_pruned",
            ) from None  # fmt: skip
        try:
            spec = spec.merged({"checkpoint": {"resume_from": str(snapshot)}})
            job, _ = self.submit(spec, parent_id=job_id, owner=owner)
        except BaseException:  # refused (the cluster cannot hold it, ...): the copy has no owner
            remove_fork_source(self.jobs_root, str(snapshot))
            raise
        self.store.add_event(
            job.id, "forked", f"forked from {job_id} at step {chosen['step']}", {"parent": job_id}
        )
        return job

    # ---- views ---------------------------------------------------------------------------------

    def cluster(self, sees: str | None = None) -> dict[str, Any]:
        """The cluster's nodes and capacity, and the jobs running and queued: for `sees` (an owner;
        None for the admin) its own jobs only, and the nodes without their addresses."""
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
        if sees is not None:
            nodes = [{k: v for k, v in node.items() if k != "address"} for node in nodes]
        total = ray.cluster_resources()
        free_cpu, free_gpu = self.scheduler.free()
        counts = self.store.counts_by_status(sees)
        return {
            "nodes": nodes,
            "cpus": {"total": total.get("CPU", 0), "free": free_cpu},
            "gpus": {"total": total.get("GPU", 0), "free": free_gpu},
            "jobs": {
                "running": sum(counts.get(s, 0) for s in RUN_HOLDING),
                "queued": counts.get(S.QUEUED, 0),
            },  # fmt: skip
        }

    def checkpoint_dirs(self, job_id: str, sees: str | None = None) -> list[dict[str, Any]]:
        self.get(job_id, sees)
        return self.store.checkpoints(job_id)


def _gpu_hint(spec: JobSpec, gpus: float, cluster_gpus: float) -> str:
    """What to give when workers whose GPUs are left to the default ask for more GPUs than there are."""
    groups = [spec.resources, spec.resources.rollout_workers]
    if gpus <= cluster_gpus or all(g is None or g.gpus_per_worker for g in groups):
        return ""
    return ("; a worker left to the default takes a whole GPU: give resources.gpus_per_worker (and "
            "resources.rollout.gpus_per_worker) as fractions to share GPUs, or fewer workers")  # fmt: skip


def _check_strict_placement(strategy: str, role: str, share: Share, nodes: list[dict[str, float]]) -> None:
    """Ray waits forever for a group's STRICT_SPREAD bundles (one per node) or STRICT_PACK ones (all on one
    node) that no set of the cluster's nodes can hold: a 422 naming the strategy instead."""

    def holds(node: dict[str, float], workers: int) -> bool:
        return node.get("CPU", 0) >= workers * share.cpus and node.get("GPU", 0) >= workers * share.gpus

    each = f"{share.workers} {role} workers ({share.cpus:g} CPUs, {share.gpus:g} GPUs each)"
    if strategy == "STRICT_SPREAD" and share.workers > (room := sum(holds(n, 1) for n in nodes)):
        why = f"STRICT_SPREAD puts each of the {each} on a node of its own; {room} node(s) of {len(nodes)} can hold one"
    elif strategy == "STRICT_PACK" and not any(holds(n, share.workers) for n in nodes):
        why = f"STRICT_PACK puts the {each} on one node; no node of {len(nodes)} can hold them all"
    else:
        return
    raise ServiceError(f"resources.placement_strategy: {why}: use PACK or SPREAD, or fewer workers",
                       422, "resources.placement_strategy", "insufficient_resources")  # fmt: skip


def _validated_merge(job: JobRecord, overrides: dict[str, Any]) -> JobSpec:
    """The job's spec (parsed once, by the store) with nested overrides, validated as a whole; a bad
    value is a 422 naming the field."""
    try:
        return job.job_spec.merged(overrides)
    except ValidationError as err:
        raise invalid_value(err) from None
