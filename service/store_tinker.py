"""The Tinker API's training runs: a table of their own (a run has no JobSpec: its row keeps its ids,
base model, rank and adapted modules, and the state every record has). The `records` view shows them
beside the jobs in the jobs' shape, a spec built from the columns, so every reader sees one kind of
record; writes go to the table that holds the id (`JobStore._table`). A store made before this table
kept runs as `method = 'tinker'` jobs: they move here when it opens (`MIGRATE`)."""

from __future__ import annotations

# column -> its declaration, and its value in a row of a store made before this table (`MIGRATE`)
_COLUMNS = {
    "id": ("TEXT PRIMARY KEY", "id"),
    "seq": ("INTEGER NOT NULL", "seq"),
    "status": ("TEXT NOT NULL", "status"),
    "owner": ("TEXT NOT NULL", "owner"),
    "model_id": ("TEXT NOT NULL", "COALESCE(json_extract(metadata, '$.tinker_model_id'), name, id)"),
    "session_id": ("TEXT NOT NULL", "COALESCE(json_extract(metadata, '$.tinker_session_id'), '')"),
    "base_model": ("TEXT NOT NULL", "json_extract(spec, '$.model.builtin')"),
    "rank": ("INTEGER NOT NULL", "COALESCE(json_extract(spec, '$.model.lora.rank'), 1)"),
    "targets": (
        "TEXT NOT NULL DEFAULT '[]'",
        "COALESCE(json_extract(spec, '$.model.lora.target_modules'), '[]')",
    ),
    "workdir": ("TEXT NOT NULL", "workdir"),
    "created_at": ("REAL NOT NULL", "created_at"),
    "started_at": ("REAL", "started_at"),
    "finished_at": ("REAL", "finished_at"),
    "step": ("INTEGER NOT NULL DEFAULT 0", "step"),
    "latest_metrics": ("TEXT NOT NULL DEFAULT '{}'", "latest_metrics"),
    "error": ("TEXT", "error"),
    "name": ("TEXT", "name"),
    "tags": ("TEXT NOT NULL DEFAULT '[]'", "tags"),
    "notes": ("TEXT NOT NULL DEFAULT ''", "notes"),
    "active_s": ("REAL NOT NULL DEFAULT 0", "active_s"),
    "run_started_at": ("REAL", "run_started_at"),
}
TINKER_COLUMNS = ", ".join(_COLUMNS)
_DECLARED = ",\n    ".join(f"{name} {declared}" for name, (declared, _) in _COLUMNS.items())
TINKER_SCHEMA = f"""
CREATE TABLE IF NOT EXISTS tinker_runs (
    {_DECLARED}
);
CREATE INDEX IF NOT EXISTS tinker_runs_model ON tinker_runs(model_id);
DROP VIEW IF EXISTS records;
CREATE VIEW records AS
    SELECT id, seq, status, method, spec, metadata, created_at, started_at, finished_at, step, total_steps,
           latest_metrics, error, parent_id, workdir, idempotency, request_hash, stop_reason, name, tags,
           notes, active_s, run_started_at, owner, restart
    FROM jobs
    UNION ALL
    SELECT id, seq, status, 'tinker',
           json_object('method', 'tinker', 'name', name, 'tags', json(tags), 'notes', notes,
                       'model', json_object('builtin', base_model, 'lora', json_object(
                           'rank', rank, 'alpha', rank, 'target_modules', json(targets))),
                       'trainer', json_object('total_steps', 0),
                       'metadata', json_object('tinker_model_id', model_id, 'tinker_session_id', session_id)),
           json_object('tinker_model_id', model_id, 'tinker_session_id', session_id),
           created_at, started_at, finished_at, step, 0, latest_metrics, error, NULL, workdir, NULL, NULL,
           NULL, name, tags, notes, active_s, run_started_at, owner, 'null'
    FROM tinker_runs;
"""
MIGRATE = f"""
INSERT OR IGNORE INTO tinker_runs ({TINKER_COLUMNS})
SELECT {", ".join(old for _, old in _COLUMNS.values())}
FROM jobs WHERE method = 'tinker';
DELETE FROM jobs WHERE method = 'tinker';
"""
