"""The audit log: one row per write the API accepted (who, the route's name as action, the resource
and its owner, the request id). Rows are only added: not even deleting a job removes them."""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from typing import Any

from service.store_db import StoreDb

AUDIT_SCHEMA = """
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
"""


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


class AuditTable(StoreDb):
    """The store's audit log (mixed into JobStore)."""

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
