"""Quotas per owner, set by the operator, and what each owner uses now (docs/ARCHITECTURE.md §8).

A field left None is unlimited. Past `queued_jobs` a submission is a 429, past a quota that waiting
cannot clear a 403; `running_jobs`, `cpus` and `gpus` are kept by the scheduler.
"""

from __future__ import annotations

import json
import os
import threading
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from service.errors import ServiceError, first_error
from service.keys import ADMIN_OWNER

if TYPE_CHECKING:
    from service.store import JobRecord

QUEUED_RETRY_AFTER_S = 30  # a queued job usually starts within a few scheduler polls once room frees


class Quota(BaseModel):
    """One owner's limits; None = unlimited (the default of all but `tinker_sessions`)."""

    model_config = ConfigDict(extra="forbid")
    running_jobs: int | None = Field(None, ge=0, le=1_000_000, description="jobs running at once")
    queued_jobs: int | None = Field(
        None, ge=0, le=1_000_000,
        description="jobs waiting in the queue at once, a new submission included (0: no submissions)",
    )  # fmt: skip
    cpus: float | None = Field(None, ge=0, le=1e9, description="CPUs held by the owner's running jobs")
    gpus: float | None = Field(None, ge=0, le=1e9, description="GPUs held by the owner's running jobs")
    stored_bytes: int | None = Field(
        None, ge=0, le=2**62, description="bytes of uploads, checkpoints and exports kept for the owner"
    )
    # a session is kept in memory until 10 minutes after its last heartbeat: never unbounded by default
    tinker_sessions: int | None = Field(
        64, ge=0, le=1_000_000, description="Tinker API client sessions at once (None: unlimited)"
    )
    tinker_models: int | None = Field(
        None, ge=0, le=1_000_000, description="Tinker API training models (LoRA adapters) live at once"
    )


class QuotaFile(BaseModel):
    model_config = ConfigDict(extra="forbid")
    default: Quota = Field(default_factory=Quota, description="every owner's, but the admin's")
    owners: dict[str, Quota] = Field(
        default_factory=dict, description="owners whose quota replaces the default"
    )


class QuotaError(ServiceError):
    """A request beyond a quota: 429 with Retry-After (clears by waiting) or 403 (a hard limit)."""

    def __init__(self, owner: str, name: str, limit: float, have: float, retry_after_s: int | None = None,
                 adding: float = 0) -> None:  # fmt: skip
        if limit == 0:  # waiting never clears a quota of 0
            retry_after_s, clears = None, f"; a quota of 0 allows none: ask the operator to raise {name}"
        elif retry_after_s:
            clears = f"; retry in {retry_after_s} s"
        else:
            clears = "; free some, or ask the operator"
        has = f"it has {have:g}" + (f" and this request adds {adding:g}" if adding else "")
        message = f"quota {name}: owner '{owner}' may have at most {limit:g} ({name.replace('_', ' ')}); {has}{clears}"
        headers = {"Retry-After": str(retry_after_s)} if retry_after_s else None
        super().__init__(message, 429 if retry_after_s else 403, f"quota.{name}", "quota_exceeded", headers)


class QuotaBook:
    """The default quota and per-owner quotas, changed live by an admin (thread-safe)."""

    def __init__(self, quotas: QuotaFile | None = None) -> None:
        self._quotas = quotas or QuotaFile()
        self._lock = threading.Lock()

    @classmethod
    def load(cls, path: str | Path | None, default: dict[str, Any] | None = None) -> QuotaBook:
        """From a quotas file (JSON or YAML), with `default`'s fields (the serve flags) over its default."""
        raw: dict[str, Any] = {}
        if path is not None:
            text = Path(path).read_text()
            if os.fspath(path).endswith((".yaml", ".yml")):
                import yaml

                raw = yaml.safe_load(text) or {}
            else:
                raw = json.loads(text)
        try:
            quotas = QuotaFile.model_validate(raw)
        except ValidationError as err:  # one line naming the field, as a serve flag's error would
            raise ValueError(first_error(err)[0]) from None
        given = {k: v for k, v in (default or {}).items() if v is not None}
        if given:
            quotas.default = quotas.default.model_copy(
                update=Quota.model_validate(given).model_dump(exclude_unset=True)
            )
        return cls(quotas)

    def of(self, owner: str) -> Quota:
        with self._lock:
            if owner in self._quotas.owners:
                return self._quotas.owners[owner]
            return Quota() if owner == ADMIN_OWNER else self._quotas.default

    def set(self, owner: str | None, quota: Quota | None) -> None:
        """Replace `owner`'s quota (None: the default); a None quota removes an owner's own."""
        with self._lock:
            if owner is None:
                self._quotas.default = quota or Quota()
            elif quota is None:
                self._quotas.owners.pop(owner, None)
            else:
                self._quotas.owners[owner] = quota

    def view(self) -> dict[str, Any]:
        with self._lock:
            return self._quotas.model_dump()


@dataclass
class Usage:
    """What one owner uses now."""

    owner: str
    running_jobs: int = 0
    queued_jobs: int = 0
    cpus: float = 0.0
    gpus: float = 0.0
    stored: dict[str, int] = field(default_factory=lambda: {"files": 0, "checkpoints": 0, "exports": 0})

    def add_running(self, cpus: float, gpus: float) -> None:
        """Count one more running record, holding these resources."""
        self.running_jobs, self.cpus, self.gpus = self.running_jobs + 1, self.cpus + cpus, self.gpus + gpus

    @property
    def stored_bytes(self) -> int:
        return sum(self.stored.values())

    def view(self, quota: Quota) -> dict[str, Any]:
        return {
            "object": "usage", "owner": self.owner, "running_jobs": self.running_jobs,
            "queued_jobs": self.queued_jobs, "cpus": self.cpus, "gpus": self.gpus,
            "stored_bytes": {**self.stored, "total": self.stored_bytes}, "quota": quota.model_dump(),
        }  # fmt: skip


def folder_bytes(folder: Path, seen: set[tuple[int, int]] | None = None) -> int:
    """Bytes of the files under `folder`; a file whose inode is in `seen` is not counted again (a fork's
    checkpoint copy is hard links to its parent's files)."""
    total, seen = 0, set() if seen is None else seen
    for root, _, names in os.walk(folder):
        for name in names:
            try:
                stat = os.lstat(os.path.join(root, name))
            except OSError:  # removed while counted (a checkpoint pruned)
                continue
            if (stat.st_dev, stat.st_ino) not in seen:
                seen.add((stat.st_dev, stat.st_ino))
                total += stat.st_size
    return total


def check_submission(quota: Quota, usage: Usage, cpus: float, gpus: float) -> None:
    """Refuse a new queued job beyond the owner's quota (QuotaError), before anything is made."""
    if quota.stored_bytes is not None and usage.stored_bytes >= quota.stored_bytes:
        raise QuotaError(usage.owner, "stored_bytes", quota.stored_bytes, usage.stored_bytes)
    for name, need in (("cpus", cpus), ("gpus", gpus)):
        limit = getattr(quota, name)
        if limit is not None and need > limit:  # it could never start
            raise QuotaError(usage.owner, name, limit, need)
    if quota.running_jobs == 0:  # no job of the owner's could ever start
        raise QuotaError(usage.owner, "running_jobs", 0, usage.running_jobs)
    if quota.queued_jobs is not None and usage.queued_jobs >= quota.queued_jobs:
        raise QuotaError(
            usage.owner, "queued_jobs", quota.queued_jobs, usage.queued_jobs, QUEUED_RETRY_AFTER_S, adding=1
        )


def check_storage(quota: Quota, usage: Usage, adding: int = 0) -> None:
    """Refuse an upload that would pass the owner's stored bytes (403)."""
    if quota.stored_bytes is not None and usage.stored_bytes + adding > quota.stored_bytes:
        raise QuotaError(usage.owner, "stored_bytes", quota.stored_bytes, usage.stored_bytes + adding)


def may_run(quota: Quota, usage: Usage, cpus: float, gpus: float) -> bool:
    """Whether the owner may start one more job needing these resources now (the scheduler's check)."""
    return (
        (quota.running_jobs is None or usage.running_jobs + 1 <= quota.running_jobs)
        and (quota.cpus is None or usage.cpus + cpus <= quota.cpus + 1e-9)
        and (quota.gpus is None or usage.gpus + gpus <= quota.gpus + 1e-9)
    )


def fair_order(
    queued: list[JobRecord], running: dict[str, int], served: dict[str, int] | None = None
) -> list[JobRecord]:
    """Queued jobs in the order they may start: rounds of every owner's oldest job not yet taken; within
    a round, fewer jobs running first, then served least recently (`served`: owner -> the number of its
    latest start), then the older job. So A's ten jobs and B's one go A1, B1, A2, ..."""
    served = served or {}
    by_owner: dict[str, list[JobRecord]] = defaultdict(list)
    for job in sorted(queued, key=lambda j: j.seq):
        by_owner[job.owner].append(job)
    order: list[JobRecord] = []
    for turn in range(max((len(jobs) for jobs in by_owner.values()), default=0)):
        batch = [jobs[turn] for jobs in by_owner.values() if turn < len(jobs)]
        order += sorted(batch, key=lambda j: (running.get(j.owner, 0), served.get(j.owner, -1), j.seq))
    return order
