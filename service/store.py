"""The job store: jobs and every record the scheduler runs, with what they produced, in SQLite.

A Tinker training run has its own table (service/store_tinker.py); the `records` view reads both as one
kind of record. Outputs, metrics, keys and the audit log are tables mixed into `JobStore`.
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from schema.job import JobSpec
from schema.section import STORED
from service.job_state import ACTIVE, RUN_HOLDING, TERMINAL, JobStatus, check_moves
from service.keys import ADMIN_OWNER, KeyTable
from service.store_metrics import MetricsQuery, MetricsTable, metrics_topic
from service.store_outputs import JobOutputs
from service.store_schema import migrate
from service.store_tinker import TINKER_COLUMNS

__all__ = ["ACTIVE", "TERMINAL", "JobRecord", "JobStore", "JobStatus", "MetricsQuery", "metrics_topic"]

JSON_COLUMNS = ("spec", "metadata", "latest_metrics", "tags", "restart")


@dataclass
class JobRecord:
    id: str
    seq: int
    status: str
    method: str
    spec: dict[str, Any]
    metadata: dict[str, str]
    created_at: float
    started_at: float | None
    finished_at: float | None
    step: int
    total_steps: int
    latest_metrics: dict[str, float]
    error: str | None
    parent_id: str | None
    workdir: str
    idempotency: str | None = None  # the Idempotency-Key its submission carried (per owner)
    request_hash: str | None = None
    stop_reason: str | None = None
    name: str | None = None
    tags: list[str] = field(default_factory=list)
    notes: str = ""
    active_s: float = 0.0  # seconds spent running, over every run of the job
    run_started_at: float | None = None  # when the current run started (None when not running)
    owner: str = ADMIN_OWNER  # the owner of the key that submitted (or forked) it
    restart: dict[str, Any] | None = None  # while the job's controller restarts its workers (recovery.py)
    stored_spec: str = field(default="", repr=False, compare=False)  # the spec column, as stored

    @property
    def job_spec(self) -> JobSpec:
        """The spec, typed: what the scheduler and the job's controller read (never the dict)."""
        return parse_spec(self.stored_spec or json.dumps(self.spec))

    @classmethod
    def from_row(cls, row: sqlite3.Row) -> JobRecord:
        values = dict(row)
        values["stored_spec"] = values["spec"]
        for key in JSON_COLUMNS:
            values[key] = json.loads(values[key])
        return cls(**values)

    def active_seconds(self, now: float | None = None) -> float:
        """Time spent running, summed over runs: a resume does not reset it."""
        current = (now or time.time()) - self.run_started_at if self.run_started_at is not None else 0.0
        return self.active_s + max(current, 0.0)


# the columns of a record, in JobRecord's order
JOB_COLUMNS = ", ".join(f.name for f in fields(JobRecord) if f.name != "stored_spec")
_PARSED: OrderedDict[str, JobSpec] = OrderedDict()  # stored text -> its JobSpec, latest used last
_PARSED_MAX = 1024
_parsed_lock = threading.Lock()


def parse_spec(stored: str) -> JobSpec:
    """A stored spec parsed once per text in this process: each scheduler poll reads its queue again, and
    the JobSpec is never changed (a change is a new text)."""
    with _parsed_lock:
        if stored in _PARSED:
            _PARSED.move_to_end(stored)
            return _PARSED[stored]
    return _remember(stored, JobSpec.model_validate_json(stored, context=STORED))


def _remember(stored: str, spec: JobSpec) -> JobSpec:
    with _parsed_lock:
        _PARSED[stored] = spec
        while len(_PARSED) > _PARSED_MAX:
            _PARSED.popitem(last=False)
    return spec


class JobStore(JobOutputs, MetricsTable, KeyTable):
    def __init__(self, path: str | Path) -> None:
        super().__init__(path)
        with self._write_lock:
            migrate(self._db())

    # ---- jobs ----------------------------------------------------------------------------------

    def create_job(
        self,
        spec: JobSpec | dict[str, Any],
        workdir_root: Path,
        idempotency: str | None = None,
        request_hash: str | None = None,
        parent_id: str | None = None,
        owner: str = ADMIN_OWNER,
    ) -> JobRecord:
        """A new row, queued. A JobSpec is kept as the row's parsed spec; a dict is parsed on first read."""
        if isinstance(spec, JobSpec):
            parsed, spec = spec, spec.model_dump(mode="json")
            _remember(json.dumps(spec), parsed)
        job_id = "job-" + uuid.uuid4().hex[:12]
        now = time.time()
        with self._tx("jobs") as db:
            seq = db.execute("SELECT COALESCE(MAX(seq), 0) + 1 FROM records").fetchone()[0]
            db.execute(
                f"INSERT INTO jobs ({JOB_COLUMNS}) VALUES ({','.join('?' * 25)})",
                (
                    job_id, seq, JobStatus.QUEUED, spec["method"], json.dumps(spec),
                    json.dumps(spec.get("metadata", {})), now, None, None, 0, spec["trainer"]["total_steps"], "{}",
                    None, parent_id, str(Path(workdir_root) / job_id), idempotency, request_hash, None,
                    spec.get("name"), json.dumps(spec.get("tags", [])), spec.get("notes", ""), 0.0, None, owner,
                    "null",
                ),
            )  # fmt: skip
        self.add_event(job_id, "created", "job created and queued")
        return self.get_job(job_id)

    def create_tinker_run(self, owner: str, model_id: str, session_id: str, base_model: str, rank: int,
                          targets: list[str], workdir_root: Path) -> JobRecord:  # fmt: skip
        """A Tinker training run's row (service/store_tinker.py), queued: the scheduler admits it."""
        run_id = "job-" + uuid.uuid4().hex[:12]  # the run id of its tinker:// checkpoint paths
        with self._tx("jobs") as db:
            seq = db.execute("SELECT COALESCE(MAX(seq), 0) + 1 FROM records").fetchone()[0]
            db.execute(
                f"INSERT INTO tinker_runs ({TINKER_COLUMNS}) VALUES ({','.join('?' * 21)})",
                (run_id, seq, JobStatus.QUEUED, owner, model_id, session_id, base_model, rank, json.dumps(targets),
                 str(Path(workdir_root) / run_id), time.time(), None, None, 0, "{}", None, model_id,
                 '["tinker"]', "", 0.0, None),
            )  # fmt: skip
        self.add_event(run_id, "created", f"Tinker training run of {model_id}, queued")
        return self.get_job(run_id)

    def tinker_runs(self, owner: str | None = None) -> list[JobRecord]:
        """Tinker training runs, newest first: `owner`'s, or everyone's."""
        return self._records("method = 'tinker' AND (?1 IS NULL OR owner = ?1)", (owner,), "seq DESC")

    def _records(self, where: str, args: tuple[Any, ...], order: str = "seq") -> list[JobRecord]:
        rows = self._rows(f"SELECT {JOB_COLUMNS} FROM records WHERE {where} ORDER BY {order}", args)
        return [JobRecord.from_row(r) for r in rows]

    def _table(self, record_id: str) -> str:
        """The table that holds a record: a Tinker run's own, or the jobs'."""
        return (
            "tinker_runs" if self._first("SELECT 1 FROM tinker_runs WHERE id = ?", (record_id,)) else "jobs"
        )

    def get_job(self, job_id: str) -> JobRecord | None:
        row = self._first(f"SELECT {JOB_COLUMNS} FROM records WHERE id = ?", (job_id,))
        return JobRecord.from_row(row) if row else None

    def job_by_idempotency_key(self, owner: str, key: str) -> JobRecord | None:
        """`owner`'s job submitted with Idempotency-Key `key`, if any."""
        query = f"SELECT {JOB_COLUMNS} FROM jobs WHERE owner = ? AND idempotency = ?"  # a run has no key
        row = self._first(query, (owner, key))
        return JobRecord.from_row(row) if row else None

    def list_jobs(
        self,
        status: list[str] | None = None,
        metadata: dict[str, str] | None = None,
        after: str | None = None,
        limit: int = 20,
        q: str | None = None,
        tag: str | None = None,
        owner: str | None = None,
    ) -> tuple[list[JobRecord], bool]:
        """(page, has_more), newest first; `after` is a job id cursor; `q` a case-insensitive substring of
        the id, name, tags or notes."""
        where, args = [], []
        if owner is not None:
            where.append("owner = ?")
            args.append(owner)
        if q:
            where.append(
                "instr(lower(id || ' ' || COALESCE(name, '') || ' ' || tags || ' ' || notes), lower(?)) > 0"
            )
            args.append(q)
        if tag:
            where.append("EXISTS (SELECT 1 FROM json_each(records.tags) WHERE value = ?)")
            args.append(tag)
        if status:
            where.append(f"status IN ({','.join('?' * len(status))})")
            args.extend(status)
        for key, value in (metadata or {}).items():  # the key as a value, never inside a JSON path
            where.append("EXISTS (SELECT 1 FROM json_each(records.metadata) WHERE key = ? AND value = ?)")
            args.extend([key, value])
        if after is not None:
            cursor = self.get_job(after)
            if cursor is None or (owner is not None and cursor.owner != owner):
                raise KeyError(after)
            where.append("seq < ?")
            args.append(cursor.seq)
        sql = f"SELECT {JOB_COLUMNS} FROM records"
        if where:
            sql += " WHERE " + " AND ".join(where)
        rows = self._rows(sql + " ORDER BY seq DESC LIMIT ?", (*args, limit + 1))
        return [JobRecord.from_row(r) for r in rows[:limit]], len(rows) > limit

    def jobs_of(self, owner: str) -> list[JobRecord]:
        return self._records("owner = ?", (owner,))

    def owners_resuming_from(self, fragment: str) -> set[str]:
        """The owners of the jobs whose `checkpoint.resume_from` holds `fragment` (a fork's copy's folder)."""
        sql = "SELECT DISTINCT owner FROM jobs WHERE instr(json_extract(spec, '$.checkpoint.resume_from'), ?) > 0"
        return {r[0] for r in self._rows(sql, (fragment,))}

    def job_owners(self) -> list[str]:
        return [r[0] for r in self._rows("SELECT DISTINCT owner FROM records")]

    def jobs_in(self, statuses: tuple[str, ...]) -> list[JobRecord]:
        return self._records(f"status IN ({','.join('?' * len(statuses))})", statuses)

    def update_job(self, job_id: str, **values: Any) -> None:
        for key in JSON_COLUMNS:
            if key in values:
                values[key] = json.dumps(values[key])
        table = self._table(job_id)
        if table == "tinker_runs":  # a run's spec is its columns (service/store_tinker.py)
            values.pop("spec", None)
        sets = ", ".join(f"{k} = ?" for k in values)
        self._write(f"UPDATE {table} SET {sets} WHERE id = ?", (*values.values(), job_id))

    def transition(
        self,
        job_id: str,
        allowed_from: tuple[JobStatus, ...],
        to: JobStatus,
        event: tuple[str, str] | None = None,
        **values: Any,
    ) -> bool:
        """Move a job to `to` if it is in one of `allowed_from` (a move job_state.TRANSITIONS lists); True
        when it moved, and then `event` (kind, message) is recorded. Leaving `running` adds the run's time
        to active_s; a terminal status sets finished_at."""
        check_moves(allowed_from, to)
        if to == JobStatus.RUNNING:
            values = {"run_started_at": time.time(), **values}
        elif to in TERMINAL:
            values = {"finished_at": time.time(), **values}
        sets = ", ".join(["status = ?"] + [f"{k} = ?" for k in values])
        if to not in RUN_HOLDING:
            sets += ", active_s = active_s + COALESCE(? - run_started_at, 0), run_started_at = NULL"
            values = {**values, "_now": time.time()}
        sources = ",".join("?" * len(allowed_from))
        sql = f"UPDATE {self._table(job_id)} SET {sets} WHERE id = ? AND status IN ({sources})"
        moved = self._write(sql, (to, *values.values(), job_id, *allowed_from)) == 1
        if moved and event is not None:
            self.add_event(job_id, *event)
        return moved

    def started(self, job_id: str, at: float) -> None:
        """Record the job's first start (a resumed job keeps it)."""
        sql = f"UPDATE {self._table(job_id)} SET started_at = COALESCE(started_at, ?) WHERE id = ?"
        self._write(sql, (at, job_id))

    def bump_step(self, job_id: str, step: int) -> None:
        """Raise the job's step to `step` (a resumed job starts past 0 before its first metrics)."""
        # no row changes when the step is already there: readers keep their cache
        self._write(
            f"UPDATE {self._table(job_id)} SET step = ? WHERE id = ? AND step < ?", (step, job_id, step)
        )

    def set_restart(self, job_id: str, restart: dict[str, Any] | None) -> None:
        """The restart under way (its message, phase, counts), or None once the job resumed or ended."""
        encoded = json.dumps(restart)  # no row changes when it is the same: readers keep their cache
        self._write(
            "UPDATE jobs SET restart = ? WHERE id = ? AND restart IS NOT ?", (encoded, job_id, encoded)
        )

    def delete_job(self, job_id: str) -> None:
        tables = ("events", "logs", "checkpoints", "samples")
        with self._tx("jobs", metrics_topic(job_id), *tables) as db:
            for table in ("events", "metrics", "logs", "checkpoints", "samples"):
                db.execute(f"DELETE FROM {table} WHERE job_id = ?", (job_id,))
            db.execute("DELETE FROM jobs WHERE id = ?", (job_id,))
            db.execute("DELETE FROM tinker_runs WHERE id = ?", (job_id,))

    def counts_by_status(self, owner: str | None = None) -> dict[str, int]:
        """Jobs per status: every owner's, or `owner`'s only."""
        sql = "SELECT status, COUNT(*) FROM records WHERE ?1 IS NULL OR owner = ?1 GROUP BY status"
        return {r[0]: r[1] for r in self._rows(sql, (owner,))}
