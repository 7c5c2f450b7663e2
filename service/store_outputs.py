"""The store's append-only rows: what a job produced (its events, sampled trajectories, log lines and
checkpoints) and the audit log.

A job's rows have increasing ids, which double as the Last-Event-ID of the live streams (api/streams.py);
only deleting a job removes them. The audit log has one row per write the API accepted (who, the route's
name as action, the resource and its owner, the request id): not even deleting a job removes those.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from service.store_db import StoreDb


@dataclass(frozen=True)
class AuditEntry:
    owner: str
    key_id: str
    action: str
    method: str
    path: str
    target: str | None
    target_owner: str | None
    status: int
    request_id: str
    data: dict[str, Any]


class JobOutputs(StoreDb):
    """The store's events, samples, logs, checkpoints and audit log (mixed into JobStore)."""

    def add_event(self, job_id: str, kind: str, message: str, data: dict[str, Any] | None = None,
                  at: float | None = None) -> int:  # fmt: skip
        row = (job_id, at or time.time(), kind, message, json.dumps(data or {}, default=str))
        return self._insert("events", "job_id, time, kind, message, data", row)

    def count_events(self, job_id: str, kind: str) -> int:
        sql = "SELECT COUNT(*) FROM events WHERE job_id = ? AND kind = ?"
        return int(self._first(sql, (job_id, kind))[0])

    def events(self, job_id: str, after_id: int = 0, limit: int = 100) -> list[dict[str, Any]]:
        sql = (
            "SELECT id, time, kind, message, data FROM events WHERE job_id = ? AND id > ? ORDER BY id LIMIT ?"
        )
        return [
            {**dict(r), "data": json.loads(r["data"])} for r in self._rows(sql, (job_id, after_id, limit))
        ]

    def add_samples(
        self, job_id: str, step: int, rows: list[dict[str, Any]], at: float | None = None
    ) -> None:
        """One row per sampled trajectory of a step (controller/trajectory_view.py)."""
        at = at or time.time()
        encoded = [(job_id, step, at, json.dumps(r, default=str)) for r in rows]
        self._insert("samples", "job_id, step, time, data", *encoded)

    def samples(self, job_id: str, step: int | None = None, after_id: int = 0, limit: int = 20) -> list[dict]:
        """Stored samples in insertion order, optionally of one step; `after_id` is the cursor."""
        sql, args = "SELECT id, step, time, data FROM samples WHERE job_id = ? AND id > ?", [job_id, after_id]
        if step is not None:
            sql += " AND step = ?"
            args.append(step)
        rows = self._rows(sql + " ORDER BY id LIMIT ?", (*args, limit))
        return [{"id": r["id"], "step": r["step"], "time": r["time"], **json.loads(r["data"])} for r in rows]

    def add_logs(self, job_id: str, lines: list[tuple[float, str, str]]) -> None:
        self._insert("logs", "job_id, time, level, line", *((job_id, *line) for line in lines))

    def logs(self, job_id: str, after_id: int = 0, tail: int | None = None, limit: int = 1000) -> list[dict]:
        sql = "SELECT id, time, level, line FROM logs WHERE job_id = ?"
        if tail is not None:
            return [dict(r) for r in self._rows(sql + " ORDER BY id DESC LIMIT ?", (job_id, tail))[::-1]]
        return [
            dict(r) for r in self._rows(sql + " AND id > ? ORDER BY id LIMIT ?", (job_id, after_id, limit))
        ]

    def add_checkpoint(self, job_id: str, step: int, path: str) -> None:
        row = (job_id, step, path, time.time())
        self._insert("checkpoints", "job_id, step, path, time", row, verb="INSERT OR REPLACE")

    def checkpoints(self, job_id: str) -> list[dict[str, Any]]:
        rows = self._rows(
            "SELECT step, path, time FROM checkpoints WHERE job_id = ? ORDER BY step", (job_id,)
        )
        return [dict(r) for r in rows if Path(r["path"], "trainer_state.json").exists()]

    def add_audit(self, entry: AuditEntry, at: float | None = None) -> int:
        row = {"time": at or time.time(), **asdict(entry), "data": json.dumps(entry.data, default=str)}
        return self._insert("audit", ", ".join(row), tuple(row.values()))

    def audit(
        self,
        before: int | None = None,
        limit: int = 100,
        owner: str | None = None,
        action: str | None = None,
        target: str | None = None,
    ) -> tuple[list[dict[str, Any]], bool]:
        """(page, has_more), newest first; `before` is the last id of the previous page."""
        where, args = [], []
        for column, value in (("owner", owner), ("action", action), ("target", target)):
            if value is not None:
                where.append(f"{column} = ?")
                args.append(value)
        if before is not None:
            where.append("id < ?")
            args.append(before)
        sql = "SELECT * FROM audit" + (" WHERE " + " AND ".join(where) if where else "")
        rows = self._rows(sql + " ORDER BY id DESC LIMIT ?", (*args, limit + 1))
        page = [{"object": "audit_entry", **dict(r), "data": json.loads(r["data"])} for r in rows[:limit]]
        return page, len(rows) > limit
