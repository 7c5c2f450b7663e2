"""The job store: jobs, their events, per-step metrics, log lines, checkpoints and API keys, in SQLite.

One database file (WAL mode, so readers never block the writer), opened per thread. Every job row
keeps its spec, state, progress and the latest metrics; events, metrics and logs are append-only
with increasing ids, which double as the Last-Event-ID of the live streams. Nothing is deleted when
a job fails or is cancelled: only DELETE on a terminal job removes its rows.

`changes(topic)` counts the committed writes that changed a topic's rows: a table ("jobs", "tokens",
...), or one job's metric series (`metrics_topic(job_id)`). The service is the only writer of its
home's store (one home has one service), so an unchanged count means unchanged rows: the API's read
cache relies on it. A write that changes no row counts nowhere.
"""

from __future__ import annotations

import json
import os
import sqlite3
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from service.audit import AUDIT_SCHEMA, AuditTable
from service.job_state import ACTIVE, RUN_HOLDING, TERMINAL, JobStatus, check_moves
from service.keys import ADMIN_OWNER, KeyTable, migrate_keys
from service.store_metrics import METRICS_SCHEMA, MetricsQuery, MetricsTable, metrics_topic
from service.store_tinker import MIGRATE, TINKER_COLUMNS, TINKER_SCHEMA

__all__ = ["ACTIVE", "TERMINAL", "JobRecord", "JobStore", "JobStatus", "MetricsQuery", "metrics_topic"]

SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    id TEXT PRIMARY KEY,
    seq INTEGER NOT NULL,
    status TEXT NOT NULL,
    method TEXT NOT NULL,
    spec TEXT NOT NULL,
    metadata TEXT NOT NULL DEFAULT '{}',
    created_at REAL NOT NULL,
    started_at REAL,
    finished_at REAL,
    step INTEGER NOT NULL DEFAULT 0,
    total_steps INTEGER NOT NULL,
    latest_metrics TEXT NOT NULL DEFAULT '{}',
    error TEXT,
    parent_id TEXT,
    workdir TEXT NOT NULL,
    idempotency TEXT,
    request_hash TEXT,
    stop_reason TEXT,
    name TEXT,
    tags TEXT NOT NULL DEFAULT '[]',
    notes TEXT NOT NULL DEFAULT '',
    active_s REAL NOT NULL DEFAULT 0,
    run_started_at REAL,
    restart TEXT NOT NULL DEFAULT 'null'
);
CREATE INDEX IF NOT EXISTS jobs_status ON jobs(status);
CREATE TABLE IF NOT EXISTS events (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    job_id TEXT NOT NULL,
    time REAL NOT NULL,
    kind TEXT NOT NULL,
    message TEXT NOT NULL,
    data TEXT NOT NULL DEFAULT '{}'
);
CREATE INDEX IF NOT EXISTS events_job ON events(job_id, id);
CREATE TABLE IF NOT EXISTS logs (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    job_id TEXT NOT NULL,
    time REAL NOT NULL,
    level TEXT NOT NULL,
    line TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS logs_job ON logs(job_id, id);
CREATE TABLE IF NOT EXISTS checkpoints (
    job_id TEXT NOT NULL,
    step INTEGER NOT NULL,
    path TEXT NOT NULL,
    time REAL NOT NULL,
    PRIMARY KEY (job_id, step)
);
CREATE TABLE IF NOT EXISTS samples (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    job_id TEXT NOT NULL,
    step INTEGER NOT NULL,
    time REAL NOT NULL,
    data TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS samples_job ON samples(job_id, step, id);
"""

ADDED_COLUMNS = {  # columns added since the first schema: a database made before gets them on open
    "name": "TEXT",
    "tags": "TEXT NOT NULL DEFAULT '[]'",
    "notes": "TEXT NOT NULL DEFAULT ''",
    "active_s": "REAL NOT NULL DEFAULT 0",
    "run_started_at": "REAL",
    "owner": "TEXT NOT NULL DEFAULT 'admin'",  # jobs made before owners existed are the admin's
    "restart": "TEXT NOT NULL DEFAULT 'null'",
    "idempotency": "TEXT",  # the client's Idempotency-Key; unique per owner (jobs_idempotency)
}
# The key as the client sent it, unique per (owner, key): no encoding of the two into one string,
# which an admin's key could imitate. Stores made before kept `idempotency_key`, globally unique:
# an owner's as "owner/key", the admin's as sent; it is read once, into `idempotency`, and no longer
# written.
IDEMPOTENCY_INDEX = "CREATE UNIQUE INDEX IF NOT EXISTS jobs_idempotency ON jobs(owner, idempotency)"
FROM_ENCODED_KEYS = """
UPDATE jobs SET idempotency = CASE
    WHEN owner != ? AND substr(idempotency_key, 1, length(owner) + 1) = owner || '/'
    THEN substr(idempotency_key, length(owner) + 2) ELSE idempotency_key END
WHERE idempotency_key IS NOT NULL
"""
JOB_COLUMNS = (
    "id, seq, status, method, spec, metadata, created_at, started_at, finished_at, step, total_steps, "
    "latest_metrics, error, parent_id, workdir, idempotency, request_hash, stop_reason, name, tags, notes, "
    "active_s, run_started_at, owner, restart"
)
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

    @classmethod
    def from_row(cls, row: sqlite3.Row) -> JobRecord:
        values = dict(row)
        for key in JSON_COLUMNS:
            values[key] = json.loads(values[key])
        return cls(**values)

    def active_seconds(self, now: float | None = None) -> float:
        """Time spent running, summed over runs: a resume does not reset it."""
        current = (now or time.time()) - self.run_started_at if self.run_started_at is not None else 0.0
        return self.active_s + max(current, 0.0)


class JobStore(MetricsTable, KeyTable, AuditTable):
    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._local = threading.local()
        self._write_lock = threading.Lock()
        self._changes: dict[str, int] = {}  # topic -> committed writes that changed it (api/read_cache.py)
        _create_private(self.path)
        with self._write_lock:
            db = self._db()
            db.executescript(SCHEMA)  # executescript manages its own transaction
            have = {r["name"] for r in db.execute("PRAGMA table_info(jobs)")}
            for name, kind in ADDED_COLUMNS.items():
                if name not in have:
                    db.execute(f"ALTER TABLE jobs ADD COLUMN {name} {kind}")
            if "idempotency" not in have and "idempotency_key" in have:
                db.execute(FROM_ENCODED_KEYS, (ADMIN_OWNER,))
            db.execute(IDEMPOTENCY_INDEX)
            db.executescript(TINKER_SCHEMA)
            db.executescript(MIGRATE)
            db.executescript(METRICS_SCHEMA)
            migrate_keys(db)
            db.executescript(AUDIT_SCHEMA)

    def _db(self) -> sqlite3.Connection:
        conn = getattr(self._local, "conn", None)
        if conn is None:
            conn = sqlite3.connect(self.path, timeout=30, isolation_level=None, check_same_thread=False)
            conn.row_factory = sqlite3.Row
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("PRAGMA synchronous=NORMAL")
            conn.execute("PRAGMA foreign_keys=ON")
            self._local.conn = conn
        return conn

    def changes(self, topic: str) -> int:
        """How many committed writes changed `topic`'s rows so far (a table name, or `metrics_topic`)."""
        return self._changes.get(topic, 0)

    @contextmanager
    def _tx(self, *topics: str) -> Iterator[sqlite3.Connection]:
        """A write transaction over `topics`: every topic whose rows it may change must be named."""
        if not topics:
            raise TypeError("a write names the topics it changes: readers' caches depend on them")
        db = self._db()
        with self._write_lock:
            before = db.total_changes
            db.execute("BEGIN IMMEDIATE")
            try:
                yield db
                db.execute("COMMIT")
            except BaseException:
                db.execute("ROLLBACK")
                raise
            # after the commit, never before: a reader that sees the new count reads the new rows
            if db.total_changes != before:
                for topic in topics:
                    self._changes[topic] = self._changes.get(topic, 0) + 1

    # ---- jobs ----------------------------------------------------------------------------------

    def create_job(
        self,
        spec: dict[str, Any],
        workdir_root: Path,
        idempotency: str | None = None,
        request_hash: str | None = None,
        parent_id: str | None = None,
        owner: str = ADMIN_OWNER,
    ) -> JobRecord:
        """A new row, queued: the scheduler runs it."""
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
        rows = self._db().execute(
            f"SELECT {JOB_COLUMNS} FROM records WHERE method = 'tinker' AND (?1 IS NULL OR owner = ?1) "
            "ORDER BY seq DESC", (owner,),
        )  # fmt: skip
        return [JobRecord.from_row(r) for r in rows.fetchall()]

    def _table(self, record_id: str) -> str:
        """The table that holds a record: a Tinker run's own, or the jobs'."""
        found = self._db().execute("SELECT 1 FROM tinker_runs WHERE id = ?", (record_id,)).fetchone()
        return "tinker_runs" if found else "jobs"

    def get_job(self, job_id: str) -> JobRecord | None:
        row = self._db().execute(f"SELECT {JOB_COLUMNS} FROM records WHERE id = ?", (job_id,)).fetchone()
        return JobRecord.from_row(row) if row else None

    def job_by_idempotency_key(self, owner: str, key: str) -> JobRecord | None:
        """`owner`'s job submitted with Idempotency-Key `key`, if any."""
        row = (
            self._db()
            .execute(f"SELECT {JOB_COLUMNS} FROM jobs WHERE owner = ? AND idempotency = ?", (owner, key))
            .fetchone()
        )
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
        """Newest first; `after` is a job id cursor; `q` a case-insensitive substring of the id, name,
        tags or notes; `tag` one of the tags; `owner` only that owner's jobs. Returns (page, has_more)."""
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
        rows = self._db().execute(sql + " ORDER BY seq DESC LIMIT ?", (*args, limit + 1)).fetchall()
        return [JobRecord.from_row(r) for r in rows[:limit]], len(rows) > limit

    def jobs_of(self, owner: str) -> list[JobRecord]:
        rows = self._db().execute(f"SELECT {JOB_COLUMNS} FROM records WHERE owner = ? ORDER BY seq", (owner,))
        return [JobRecord.from_row(r) for r in rows.fetchall()]

    def owners_resuming_from(self, fragment: str) -> set[str]:
        """The owners of the jobs whose `checkpoint.resume_from` holds `fragment` (a fork's copy's folder)."""
        rows = self._db().execute(
            "SELECT DISTINCT owner FROM jobs WHERE instr(json_extract(spec, '$.checkpoint.resume_from'), ?) > 0",
            (fragment,),
        )
        return {r[0] for r in rows.fetchall()}

    def job_owners(self) -> list[str]:
        return [r[0] for r in self._db().execute("SELECT DISTINCT owner FROM records").fetchall()]

    def jobs_in(self, statuses: tuple[str, ...]) -> list[JobRecord]:
        rows = (
            self._db()
            .execute(
                f"SELECT {JOB_COLUMNS} FROM records WHERE status IN ({','.join('?' * len(statuses))}) ORDER BY seq",
                statuses,
            )
            .fetchall()
        )
        return [JobRecord.from_row(r) for r in rows]

    def update_job(self, job_id: str, **values: Any) -> None:
        for key in JSON_COLUMNS:
            if key in values:
                values[key] = json.dumps(values[key])
        table = self._table(job_id)
        if table == "tinker_runs":  # a run's spec is its columns (service/store_tinker.py)
            values.pop("spec", None)
        sets = ", ".join(f"{k} = ?" for k in values)
        with self._tx("jobs") as db:
            db.execute(f"UPDATE {table} SET {sets} WHERE id = ?", (*values.values(), job_id))

    def transition(
        self, job_id: str, allowed_from: tuple[JobStatus, ...], to: JobStatus, **values: Any
    ) -> bool:
        """Move a job to `to` only if it is in one of `allowed_from`; True when it moved. Every move
        must be in job_state.TRANSITIONS. Leaving `running` ends a run: its time is added to active_s."""
        check_moves(allowed_from, to)
        if to == JobStatus.RUNNING:
            values = {"run_started_at": time.time(), **values}
        sets = ", ".join(["status = ?"] + [f"{k} = ?" for k in values])
        if to not in RUN_HOLDING:
            sets += ", active_s = active_s + COALESCE(? - run_started_at, 0), run_started_at = NULL"
            values = {**values, "_now": time.time()}
        table = self._table(job_id)
        with self._tx("jobs") as db:
            cur = db.execute(
                f"UPDATE {table} SET {sets} WHERE id = ? AND status IN ({','.join('?' * len(allowed_from))})",
                (to, *values.values(), job_id, *allowed_from),
            )
            return cur.rowcount == 1

    def started(self, job_id: str, at: float) -> None:
        """Record the job's first start (a resumed job keeps it)."""
        with self._tx("jobs") as db:
            db.execute(f"UPDATE {self._table(job_id)} SET started_at = COALESCE(started_at, ?) WHERE id = ?",
                       (at, job_id))  # fmt: skip

    def bump_step(self, job_id: str, step: int) -> None:
        """Raise the job's step to `step` (a resumed job starts past 0 before its first metrics)."""
        with self._tx("jobs") as db:  # no row changes when the step is already there: readers keep theirs
            db.execute(
                f"UPDATE {self._table(job_id)} SET step = ? WHERE id = ? AND step < ?", (step, job_id, step)
            )

    def set_restart(self, job_id: str, restart: dict[str, Any] | None) -> None:
        """The restart under way (its message, phase, counts), or None once the job resumed or ended."""
        with self._tx("jobs") as db:  # no row changes when it is the same: readers keep their cache
            db.execute(
                "UPDATE jobs SET restart = ? WHERE id = ? AND restart IS NOT ?",
                (json.dumps(restart), job_id, json.dumps(restart)),
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
        if owner is None:
            rows = self._db().execute("SELECT status, COUNT(*) FROM records GROUP BY status").fetchall()
        else:
            rows = (
                self._db()
                .execute("SELECT status, COUNT(*) FROM records WHERE owner = ? GROUP BY status", (owner,))
                .fetchall()
            )
        return {r[0]: r[1] for r in rows}

    # ---- events, metrics, logs, checkpoints ----------------------------------------------------

    def add_event(self, job_id: str, kind: str, message: str, data: dict[str, Any] | None = None,
                  at: float | None = None) -> int:  # fmt: skip
        with self._tx("events") as db:
            cur = db.execute(
                "INSERT INTO events (job_id, time, kind, message, data) VALUES (?,?,?,?,?)",
                (job_id, at or time.time(), kind, message, json.dumps(data or {}, default=str)),
            )
            return int(cur.lastrowid)

    def count_events(self, job_id: str, kind: str) -> int:
        row = (
            self._db()
            .execute("SELECT COUNT(*) FROM events WHERE job_id = ? AND kind = ?", (job_id, kind))
            .fetchone()
        )
        return int(row[0])

    def events(self, job_id: str, after_id: int = 0, limit: int = 100) -> list[dict[str, Any]]:
        rows = (
            self._db()
            .execute(
                "SELECT id, time, kind, message, data FROM events WHERE job_id = ? AND id > ? ORDER BY id LIMIT ?",
                (job_id, after_id, limit),
            )
            .fetchall()
        )
        return [{**dict(r), "data": json.loads(r["data"])} for r in rows]

    def add_samples(
        self, job_id: str, step: int, rows: list[dict[str, Any]], at: float | None = None
    ) -> None:
        """One row per sampled trajectory of a step (controller/trajectory_view.py)."""
        with self._tx("samples") as db:
            db.executemany(
                "INSERT INTO samples (job_id, step, time, data) VALUES (?,?,?,?)",
                [(job_id, step, at or time.time(), json.dumps(r, default=str)) for r in rows],
            )

    def samples(self, job_id: str, step: int | None = None, after_id: int = 0, limit: int = 20) -> list[dict]:
        """Stored samples in insertion order, optionally of one step; `after_id` is the cursor."""
        sql, args = "SELECT id, step, time, data FROM samples WHERE job_id = ? AND id > ?", [job_id, after_id]
        if step is not None:
            sql += " AND step = ?"
            args.append(step)
        rows = self._db().execute(sql + " ORDER BY id LIMIT ?", (*args, limit)).fetchall()
        return [{"id": r["id"], "step": r["step"], "time": r["time"], **json.loads(r["data"])} for r in rows]

    def add_logs(self, job_id: str, lines: list[tuple[float, str, str]]) -> None:
        if not lines:
            return
        with self._tx("logs") as db:
            db.executemany(
                "INSERT INTO logs (job_id, time, level, line) VALUES (?,?,?,?)",
                [(job_id, t, level, line) for t, level, line in lines],
            )

    def logs(self, job_id: str, after_id: int = 0, tail: int | None = None, limit: int = 1000) -> list[dict]:
        if tail is not None:
            rows = (
                self._db()
                .execute(
                    "SELECT id, time, level, line FROM logs WHERE job_id = ? ORDER BY id DESC LIMIT ?",
                    (job_id, tail),
                )
                .fetchall()[::-1]
            )
        else:
            rows = (
                self._db()
                .execute(
                    "SELECT id, time, level, line FROM logs WHERE job_id = ? AND id > ? ORDER BY id LIMIT ?",
                    (job_id, after_id, limit),
                )
                .fetchall()
            )
        return [dict(r) for r in rows]

    def add_checkpoint(self, job_id: str, step: int, path: str) -> None:
        with self._tx("checkpoints") as db:
            db.execute(
                "INSERT OR REPLACE INTO checkpoints (job_id, step, path, time) VALUES (?,?,?,?)",
                (job_id, step, path, time.time()),
            )

    def checkpoints(self, job_id: str) -> list[dict[str, Any]]:
        rows = (
            self._db()
            .execute("SELECT step, path, time FROM checkpoints WHERE job_id = ? ORDER BY step", (job_id,))
            .fetchall()
        )
        return [dict(r) for r in rows if Path(r["path"], "trainer_state.json").exists()]


def _create_private(path: Path) -> None:
    """The database holds token hashes and every job's data: readable by its owner only (0600).
    SQLite gives its -wal and -shm files the database file's mode."""
    os.close(os.open(path, os.O_CREAT | os.O_RDWR, 0o600))
    os.chmod(path, 0o600)
