"""A job's metric series in the store: one row per (job, step), read in pages and downsampled.

Writing a step that has a row replaces it under a new, larger id (a live stream sees the new values):
a job resumed from a checkpoint re-runs the steps after it, which must not be stored twice.
"""

from __future__ import annotations

import json
import math
import sqlite3
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from service.store_db import StoreDb

SELECT = "SELECT id, step, time, data FROM metrics WHERE job_id = ?"


@dataclass(frozen=True)
class MetricsQuery:
    """Which rows of a job's series to return; every field is optional."""

    keys: tuple[str, ...] = ()  # exact names, or prefixes ending in '*'
    step_min: int | None = None
    step_max: int | None = None
    after_step: int | None = None  # steps strictly after this one (the paging cursor)
    last: int | None = None  # only the last N steps (after the filters above)
    every: int | None = None  # only steps divisible by K
    max_points: int | None = None  # at most P steps, evenly spaced, the last always kept
    limit: int = 10_000  # a page: at most this many rows, in step order


def metrics_topic(job_id: str) -> str:
    """One job's series as a change topic: a write to it leaves other series' cached pages valid."""
    return "metrics:" + job_id


def finite(values: dict[str, Any]) -> dict[str, float | None]:
    """A diverged run logs NaN or inf; JSON has no such numbers, so they are stored as null."""
    return {k: (v if isinstance(v, int | float) and math.isfinite(v) else None) for k, v in values.items()}


def pick_keys(values: dict[str, Any], keys: tuple[str, ...]) -> dict[str, Any]:
    if not keys:
        return values
    exact = {k for k in keys if not k.endswith("*")}
    prefixes = tuple(k[:-1] for k in keys if k.endswith("*"))
    return {k: v for k, v in values.items() if k in exact or (prefixes and k.startswith(prefixes))}


def evenly(steps: list[int], points: int) -> list[int]:
    """At most `points` of `steps`, evenly spaced, first and last kept (the last alone when points=1)."""
    if len(steps) <= points:
        return steps
    if points == 1:
        return steps[-1:]
    span = len(steps) - 1
    return [steps[round(i * span / (points - 1))] for i in range(points)]


class MetricsTable(StoreDb):
    """The metrics part of JobStore (mixed in: it uses the store's connections and write lock)."""

    def add_metrics(self, job_id: str, step: int, values: dict[str, float], at: float | None = None) -> int:
        values = finite(values)
        with self._tx(metrics_topic(job_id), "jobs") as db:  # the job's step and latest metrics too
            db.execute("DELETE FROM metrics WHERE job_id = ? AND step = ?", (job_id, step))
            cur = db.execute(
                "INSERT INTO metrics (job_id, step, time, data) VALUES (?,?,?,?)",
                (job_id, step, at or time.time(), json.dumps(values)),
            )
            for table in ("jobs", "tinker_runs"):  # the record's own table holds it; the other has no such id
                db.execute(
                    f"UPDATE {table} SET step = MAX(step, ?), latest_metrics = ? WHERE id = ?",
                    (step, json.dumps(values), job_id),
                )
            return int(cur.lastrowid)

    def truncate_after(self, job_id: str, step: int) -> None:
        """Forget what was recorded after `step` (the checkpoint a job resumes from): the job's step
        and latest metrics go back to that step's."""
        with self._tx(metrics_topic(job_id), "jobs") as db:
            db.execute("DELETE FROM metrics WHERE job_id = ? AND step > ?", (job_id, step))
            row = db.execute(
                "SELECT data FROM metrics WHERE job_id = ? ORDER BY step DESC LIMIT 1", (job_id,)
            ).fetchone()
            latest = row["data"] if row else "{}"
            for table in ("jobs", "tinker_runs"):
                db.execute(
                    f"UPDATE {table} SET step = ?, latest_metrics = ? WHERE id = ?", (step, latest, job_id)
                )

    def metrics_since(self, job_id: str, after_id: int = 0, limit: int = 200) -> list[dict[str, Any]]:
        """Rows written after row `after_id`, in write order: what a live stream sends next."""
        sql = f"{SELECT} AND id > ? ORDER BY id LIMIT ?"
        return [_row(r, ()) for r in self._rows(sql, (job_id, after_id, limit))]

    def metrics_page(
        self, job_id: str, query: MetricsQuery = MetricsQuery()
    ) -> tuple[list[dict[str, Any]], bool]:
        """One page of the series in step order, and whether more steps follow it."""
        rows, more = self._page_rows(job_id, query)
        return [_row(r, query.keys) for r in rows], more

    def metrics_page_json(self, job_id: str, query: MetricsQuery = MetricsQuery()) -> tuple[list[str], bool]:
        """`metrics_page` with each row as its JSON text (what json.dumps makes of the row)."""
        rows, more = self._page_rows(job_id, query)
        return [_row_json(r, query.keys) for r in rows], more

    def export_metrics(self, job_id: str, keys: tuple[str, ...] = ()) -> Iterator[dict[str, Any]]:
        """Every row of the series in step order, read in batches (for the export route)."""
        after = -(2**62)
        while True:
            rows = self._rows(f"{SELECT} AND step > ? ORDER BY step LIMIT 1000", (job_id, after))
            if not rows:
                return
            yield from (_row(r, keys) for r in rows)
            after = rows[-1]["step"]

    def _page_rows(self, job_id: str, query: MetricsQuery) -> tuple[list[sqlite3.Row], bool]:
        """The rows of one page (in step order), and whether more steps follow it."""
        steps = self._rows(*_step_sql(job_id, query))
        chosen = [r[0] for r in steps]
        if query.last is not None:
            chosen = chosen[-query.last :] if query.last else []
        if query.max_points is not None:
            chosen = evenly(chosen, query.max_points)
        page, more = chosen[: query.limit], len(chosen) > query.limit
        return self._rows_at(job_id, page), more

    def _rows_at(self, job_id: str, steps: list[int]) -> list[sqlite3.Row]:
        out: list[sqlite3.Row] = []
        for start in range(0, len(steps), 500):  # SQLite caps the number of bound parameters
            chunk = steps[start : start + 500]
            out += self._rows(
                f"{SELECT} AND step IN ({','.join('?' * len(chunk))}) ORDER BY step", (job_id, *chunk)
            )
        return out


def _step_sql(job_id: str, q: MetricsQuery) -> tuple[str, list[Any]]:
    sql, args = "SELECT step FROM metrics WHERE job_id = ?", [job_id]
    for clause, value in (("step >= ?", q.step_min), ("step <= ?", q.step_max), ("step > ?", q.after_step)):
        if value is not None:
            sql += f" AND {clause}"
            args.append(value)
    if q.every:
        sql += " AND step % ? = 0"
        args.append(q.every)
    return sql + " ORDER BY step", args


def _row(r: sqlite3.Row, keys: tuple[str, ...]) -> dict[str, Any]:
    return {
        "id": r["id"],
        "step": r["step"],
        "time": r["time"],
        "values": pick_keys(json.loads(r["data"]), keys),
    }


def _row_json(r: sqlite3.Row, keys: tuple[str, ...]) -> str:
    """json.dumps(_row(r, keys)); with every key the stored text (json.dumps output already) is spliced
    in as it is, rather than parsed and encoded again to the same text."""
    if keys:
        return json.dumps(_row(r, keys))
    row_id, step, at, data = r  # SELECT's columns, in order
    return f'{{"id": {row_id}, "step": {step}, "time": {float.__repr__(at)}, "values": {data}}}'
