"""What a job produced, in the store: its events, sampled trajectories, log lines and checkpoints.

Each is append-only with increasing ids, which double as the Last-Event-ID of the live streams
(api/streams.py); a job's metrics are their own table (service/store_metrics.py). Nothing is deleted
when a job fails or is cancelled: only deleting a terminal job removes its rows (`JobStore.delete_job`).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from service.store_db import StoreDb


class JobOutputs(StoreDb):
    """The store's events, samples, logs and checkpoints (mixed into JobStore)."""

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
