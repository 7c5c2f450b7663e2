"""The Tinker API's training runs: a table of their own (a run has no JobSpec: its row keeps its ids,
base model, rank and adapted modules, and the state every record has). The `records` view shows them
beside the jobs in the jobs' shape, a spec built from the columns, so every reader sees one kind of
record; writes go to the table that holds the id (`JobStore._table`). A store made before this table
kept runs as `method = 'tinker'` jobs: they move here when it opens (`MIGRATE`)."""

from __future__ import annotations

TINKER_SCHEMA = """
CREATE TABLE IF NOT EXISTS tinker_runs (
    id TEXT PRIMARY KEY,
    seq INTEGER NOT NULL,
    status TEXT NOT NULL,
    owner TEXT NOT NULL,
    model_id TEXT NOT NULL,
    session_id TEXT NOT NULL,
    base_model TEXT NOT NULL,
    rank INTEGER NOT NULL,
    targets TEXT NOT NULL DEFAULT '[]',
    workdir TEXT NOT NULL,
    created_at REAL NOT NULL,
    started_at REAL,
    finished_at REAL,
    step INTEGER NOT NULL DEFAULT 0,
    latest_metrics TEXT NOT NULL DEFAULT '{}',
    error TEXT,
    name TEXT,
    tags TEXT NOT NULL DEFAULT '[]',
    notes TEXT NOT NULL DEFAULT '',
    active_s REAL NOT NULL DEFAULT 0,
    run_started_at REAL
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
TINKER_COLUMNS = (
    "id, seq, status, owner, model_id, session_id, base_model, rank, targets, workdir, created_at, started_at, "
    "finished_at, step, latest_metrics, error, name, tags, notes, active_s, run_started_at"
)
# The rows a store made before this table kept in the jobs table.
MIGRATE = f"""
INSERT OR IGNORE INTO tinker_runs ({TINKER_COLUMNS})
SELECT id, seq, status, owner, COALESCE(json_extract(metadata, '$.tinker_model_id'), name, id),
       COALESCE(json_extract(metadata, '$.tinker_session_id'), ''), json_extract(spec, '$.model.builtin'),
       COALESCE(json_extract(spec, '$.model.lora.rank'), 1),
       COALESCE(json_extract(spec, '$.model.lora.target_modules'), '[]'), workdir, created_at, started_at,
       finished_at, step, latest_metrics, error, name, tags, notes, active_s, run_started_at
FROM jobs WHERE method = 'tinker';
DELETE FROM jobs WHERE method = 'tinker';
"""
