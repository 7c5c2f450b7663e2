-- A store made by the code before Tinker runs had a table of their own (5195e02): an RL job and two
-- `method: tinker` rows of the jobs table, one running with a metric, one succeeded. `sqlite3 .dump`.
BEGIN TRANSACTION;
CREATE TABLE audit (
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
CREATE TABLE checkpoints (
    job_id TEXT NOT NULL,
    step INTEGER NOT NULL,
    path TEXT NOT NULL,
    time REAL NOT NULL,
    PRIMARY KEY (job_id, step)
);
CREATE TABLE events (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    job_id TEXT NOT NULL,
    time REAL NOT NULL,
    kind TEXT NOT NULL,
    message TEXT NOT NULL,
    data TEXT NOT NULL DEFAULT '{}'
);
INSERT INTO "events" VALUES(1,'job-8351f70d9622',1.79583525271142125127e+09,'created','job created and queued','{}');
INSERT INTO "events" VALUES(2,'job-1892f8386ed3',1.79583525271181106567e+09,'created','created (running)','{}');
INSERT INTO "events" VALUES(3,'job-6c8585b5170a',1.79583525271221971508e+09,'created','created (running)','{}');
CREATE TABLE jobs (
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
, owner TEXT NOT NULL DEFAULT 'admin');
INSERT INTO "jobs" VALUES('job-8351f70d9622',1,'queued','grpo','{"method": "grpo", "model": {"builtin": "tiny-qwen2"}, "trainer": {"total_steps": 5}, "name": "an rl job"}','{}',1.79583525270095562932e+09,NULL,NULL,0,5,'{}',NULL,NULL,'/srv/tandem/jobs/job-8351f70d9622',NULL,NULL,NULL,'an rl job','[]','',0.0,NULL,'null','alice');
INSERT INTO "jobs" VALUES('job-1892f8386ed3',2,'running','tinker','{"method": "tinker", "model": {"builtin": "tiny-qwen2", "lora": {"rank": 8, "alpha": 8, "target_modules": ["attn", "mlp", "unembed"]}}, "trainer": {"total_steps": 0}, "name": "sess-0123456789ab:train:0", "metadata": {"tinker_model_id": "sess-0123456789ab:train:0", "tinker_session_id": "sess-0123456789ab"}, "tags": ["tinker"]}','{"tinker_model_id": "sess-0123456789ab:train:0", "tinker_session_id": "sess-0123456789ab"}',1.79583525271169281009e+09,1.79583525271169281009e+09,NULL,1,0,'{"train/loss:sum": 3.5}',NULL,NULL,'/srv/tandem/jobs/job-1892f8386ed3',NULL,NULL,NULL,'sess-0123456789ab:train:0','["tinker"]','',0.0,NULL,'null','alice');
INSERT INTO "jobs" VALUES('job-6c8585b5170a',3,'succeeded','tinker','{"method": "tinker", "model": {"builtin": "tiny-qwen2", "lora": {"rank": 4, "alpha": 4, "target_modules": ["attn", "mlp", "unembed"]}}, "trainer": {"total_steps": 0}, "name": "sess-0123456789ab:train:1", "metadata": {"tinker_model_id": "sess-0123456789ab:train:1", "tinker_session_id": "sess-0123456789ab"}, "tags": ["tinker"]}','{"tinker_model_id": "sess-0123456789ab:train:1", "tinker_session_id": "sess-0123456789ab"}',1.79583525271212220194e+09,NULL,NULL,0,0,'{}',NULL,NULL,'/srv/tandem/jobs/job-6c8585b5170a',NULL,NULL,NULL,'sess-0123456789ab:train:1','["tinker"]','',0.0,NULL,'null','bob');
CREATE TABLE logs (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    job_id TEXT NOT NULL,
    time REAL NOT NULL,
    level TEXT NOT NULL,
    line TEXT NOT NULL
);
CREATE TABLE metrics (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    job_id TEXT NOT NULL,
    step INTEGER NOT NULL,
    time REAL NOT NULL,
    data TEXT NOT NULL
);
INSERT INTO "metrics" VALUES(1,'job-1892f8386ed3',1,1.79583525271197557444e+09,'{"train/loss:sum": 3.5}');
CREATE TABLE samples (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    job_id TEXT NOT NULL,
    step INTEGER NOT NULL,
    time REAL NOT NULL,
    data TEXT NOT NULL
);
CREATE TABLE tokens (
    id TEXT PRIMARY KEY,
    name TEXT NOT NULL,
    hash TEXT NOT NULL UNIQUE,
    scopes TEXT NOT NULL,
    created_at REAL NOT NULL
, owner TEXT NOT NULL DEFAULT 'admin', admin INTEGER NOT NULL DEFAULT 1, expires_at REAL, revoked_at REAL, last_used_at REAL);
CREATE INDEX jobs_status ON jobs(status);
CREATE INDEX events_job ON events(job_id, id);
CREATE INDEX logs_job ON logs(job_id, id);
CREATE INDEX samples_job ON samples(job_id, step, id);
CREATE UNIQUE INDEX jobs_idempotency ON jobs(owner, idempotency);
CREATE UNIQUE INDEX metrics_job_step ON metrics(job_id, step);
CREATE INDEX metrics_job_id ON metrics(job_id, id);
CREATE INDEX audit_owner ON audit(owner, id);
DELETE FROM "sqlite_sequence";
INSERT INTO "sqlite_sequence" VALUES('events',3);
INSERT INTO "sqlite_sequence" VALUES('metrics',1);
COMMIT;
