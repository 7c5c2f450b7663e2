"""The store's tables, and how a database made by an older version is brought up to date on open:
every table's schema and migration runs here, in one order."""

from __future__ import annotations

import sqlite3

from service.keys import ADMIN_OWNER
from service.store_tinker import MIGRATE, TINKER_SCHEMA

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
    request_hash TEXT,
    stop_reason TEXT
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
CREATE TABLE IF NOT EXISTS audit (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    time REAL NOT NULL,
    owner TEXT NOT NULL,
    key_id TEXT NOT NULL,
    action TEXT NOT NULL,
    method TEXT NOT NULL,
    path TEXT NOT NULL,
    target TEXT,
    target_owner TEXT,
    status INTEGER NOT NULL,
    request_id TEXT NOT NULL,
    data TEXT NOT NULL DEFAULT '{}'
);
CREATE INDEX IF NOT EXISTS audit_owner ON audit(owner, id);
CREATE TABLE IF NOT EXISTS tokens (
    id TEXT PRIMARY KEY,
    name TEXT NOT NULL,
    hash TEXT NOT NULL UNIQUE,
    scopes TEXT NOT NULL,
    created_at REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS metrics (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    job_id TEXT NOT NULL,
    step INTEGER NOT NULL,
    time REAL NOT NULL,
    data TEXT NOT NULL
);
-- one row per (job, step): a store made before keeps each step's latest
DELETE FROM metrics WHERE id NOT IN (SELECT MAX(id) FROM metrics GROUP BY job_id, step);
DROP INDEX IF EXISTS metrics_job;
CREATE UNIQUE INDEX IF NOT EXISTS metrics_job_step ON metrics(job_id, step);
CREATE INDEX IF NOT EXISTS metrics_job_id ON metrics(job_id, id);
"""

ADDED_COLUMNS = {  # columns added since the first schema: every database gets them on open, a new one too
    "name": "TEXT",
    "tags": "TEXT NOT NULL DEFAULT '[]'",
    "notes": "TEXT NOT NULL DEFAULT ''",
    "active_s": "REAL NOT NULL DEFAULT 0",
    "run_started_at": "REAL",
    "owner": "TEXT NOT NULL DEFAULT 'admin'",  # jobs made before owners existed are the admin's
    "restart": "TEXT NOT NULL DEFAULT 'null'",
    "idempotency": "TEXT",  # the client's Idempotency-Key; unique per owner (jobs_idempotency)
}
KEY_COLUMNS_ADDED = {  # the same for API keys: keys made before them belong to admin and see everything
    "owner": "TEXT NOT NULL DEFAULT 'admin'",
    "admin": "INTEGER NOT NULL DEFAULT 1",
    "expires_at": "REAL",
    "revoked_at": "REAL",
    "last_used_at": "REAL",
}
# The key as sent, unique per (owner, key): an "owner/key" encoding could be imitated by an admin's
# key. Older stores' `idempotency_key` ("owner/key", the admin's as sent) is read once into it.
IDEMPOTENCY_INDEX = "CREATE UNIQUE INDEX IF NOT EXISTS jobs_idempotency ON jobs(owner, idempotency)"
FROM_ENCODED_KEYS = """
UPDATE jobs SET idempotency = CASE
    WHEN owner != ? AND substr(idempotency_key, 1, length(owner) + 1) = owner || '/'
    THEN substr(idempotency_key, length(owner) + 2) ELSE idempotency_key END
WHERE idempotency_key IS NOT NULL
"""


def migrate(db: sqlite3.Connection) -> None:
    """Outside a transaction: executescript manages its own."""
    db.executescript(SCHEMA)
    have = add_columns(db, "jobs", ADDED_COLUMNS)
    if "idempotency" not in have and "idempotency_key" in have:
        db.execute(FROM_ENCODED_KEYS, (ADMIN_OWNER,))
    db.execute(IDEMPOTENCY_INDEX)
    db.executescript(TINKER_SCHEMA)
    db.executescript(MIGRATE)
    add_columns(db, "tokens", KEY_COLUMNS_ADDED)


def add_columns(db: sqlite3.Connection, table: str, columns: dict[str, str]) -> set[str]:
    """Add the `columns` (name -> SQL type) a table lacks; the names it had."""
    have = {r["name"] for r in db.execute(f"PRAGMA table_info({table})")}
    for name, kind in columns.items():
        if name not in have:
            db.execute(f"ALTER TABLE {table} ADD COLUMN {name} {kind}")
    return have
