"""What each owner uses now, read from the store and the disk on each call: quotas are checked against
what is, not against a counter that could drift."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from service.files import FileStore
from service.job_state import RUN_HOLDING, JobStatus
from service.quotas import Usage
from service.store import JobRecord, JobStore


def measure(store: JobStore, files: FileStore, owner: str, workload_of: Callable[[JobRecord], Any]) -> Usage:
    """Every record of the owner counts, of whatever workload kind (a Tinker run as a job)."""
    usage = Usage(owner)
    for job in store.jobs_of(owner):
        if job.status == JobStatus.QUEUED:
            usage.queued_jobs += 1
        elif job.status in RUN_HOLDING:
            needs = workload_of(job).needs(job.spec)
            usage.add_running(needs.cpus, needs.gpus)
        usage.stored["checkpoints"] += folder_bytes(Path(job.workdir, "checkpoints"))
        usage.stored["exports"] += folder_bytes(Path(job.workdir, "export"))
    usage.stored["files"] = sum(r.bytes for r in files.records(owner))
    return usage


def owners(store: JobStore, files: FileStore) -> list[str]:
    """Every owner with a key, a job or a file."""
    return sorted(set(store.key_owners()) | set(store.job_owners()) | {r.owner for r in files.records()})


def folder_bytes(folder: Path) -> int:
    total = 0
    for root, _, names in os.walk(folder):
        for name in names:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except OSError:  # removed while counted (a checkpoint pruned)
                pass
    return total
