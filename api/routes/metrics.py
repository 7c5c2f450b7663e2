"""A job's metric series: pages of one row per step (`{"step", "time", "values"}`), downsampled views,
a live stream, and a CSV/JSON export. A page is cached encoded until the job's series changes.
"""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Iterator
from typing import Any, Literal

from fastapi import APIRouter, Query, Request, Response
from fastapi.responses import StreamingResponse

from api.body_checks import CheckedRoute
from api.deps import AUTH_ERRORS, INT64_MAX, READ, CallerDep, HotReadsDep, ServiceDep
from api.errors import documented, invalid
from api.streams import stream_route
from api.views import listing_json
from service.store import MetricsQuery, metrics_topic

router = APIRouter(
    prefix="/v1/jobs/{job_id}/metrics",
    tags=["metrics"],
    route_class=CheckedRoute,
    responses={**AUTH_ERRORS, **documented(404)},
)
MAX_STEP = INT64_MAX - 1  # after_step + 1 must still be a SQLite integer
MAX_KEYS = 100


def parse_keys(keys: str | None) -> tuple[str, ...]:
    """The names asked for; each row of a page is matched against every one, so they are bounded."""
    names = tuple(k.strip() for k in (keys or "").split(",") if k.strip())
    if len(names) > MAX_KEYS:
        why = f"{len(names)} names; at most {MAX_KEYS} are allowed ('prefix/*' matches a whole group)"
        raise invalid("keys", why, "too_many_keys")
    return names


@router.get("", dependencies=READ, response_model=dict[str, Any])
async def metrics(
    request: Request,
    job_id: str,
    service: ServiceDep,
    caller: CallerDep,
    hot: HotReadsDep,
    keys: str | None = Query(None, description="comma-separated names; 'prefix/*' matches a prefix"),
    step_min: int | None = Query(None, ge=0, le=MAX_STEP),
    step_max: int | None = Query(None, ge=0, le=MAX_STEP),
    after_step: int | None = Query(None, ge=-1, le=MAX_STEP, description="steps after this one (paging)"),
    last: int | None = Query(None, ge=0, le=10_000_000, description="only the last N steps"),
    every: int | None = Query(None, ge=1, le=10_000_000, description="only steps divisible by K"),
    max_points: int | None = Query(None, ge=1, le=100_000, description="at most P steps, evenly spaced"),
    limit: int = Query(10_000, ge=1, le=100_000, description="at most this many rows per page"),
) -> Response:
    query = MetricsQuery(parse_keys(keys), step_min, step_max, after_step, last, every, max_points, limit)

    def read() -> bytes:
        service.get(job_id, caller.sees)
        return listing_json(*service.store.metrics_page_json(job_id, query))

    # the viewer is part of the key: a page read for its owner is never answered to another owner
    return await hot.answer(
        request, ("metrics", job_id, query, caller.sees), metrics_topic(job_id), read, _as_is
    )


def _as_is(page: bytes) -> bytes:
    return page  # a metrics page is cached encoded: it has no live fields


stream_route(router, "/stream", "metrics_stream", "metrics_since", 200, "metrics", MAX_STEP)


@router.get("/export", dependencies=READ)
def export(
    job_id: str,
    service: ServiceDep,
    caller: CallerDep,
    format: Literal["csv", "json"] = Query("csv", description="csv: one column per metric; json: a list"),
    keys: str | None = Query(None, description="comma-separated names; 'prefix/*' matches a prefix"),
) -> StreamingResponse:
    service.get(job_id, caller.sees)
    rows = service.store.export_metrics(job_id, parse_keys(keys))
    disposition = {"Content-Disposition": f'attachment; filename="{job_id}-metrics.{format}"'}
    if format == "json":
        return StreamingResponse(_json_lines(rows), media_type="application/json", headers=disposition)
    columns = _columns(service, job_id, parse_keys(keys))
    return StreamingResponse(_csv(rows, columns), media_type="text/csv", headers=disposition)


def _columns(service: Any, job_id: str, keys: tuple[str, ...]) -> list[str]:
    names: set[str] = set()
    for row in service.store.export_metrics(job_id, keys):
        names |= row["values"].keys()
    return sorted(names)


def _csv(rows: Iterator[dict[str, Any]], columns: list[str]) -> Iterator[str]:
    out = io.StringIO()
    writer = csv.writer(out)
    writer.writerow(["step", "time", *columns])
    for row in rows:
        values = row["values"]
        writer.writerow(
            [row["step"], row["time"], *("" if values.get(c) is None else values[c] for c in columns)]
        )
        if out.tell() > 64_000:
            yield out.getvalue()
            out.seek(0)
            out.truncate()
    yield out.getvalue()


def _json_lines(rows: Iterator[dict[str, Any]]) -> Iterator[str]:
    """A JSON list written row by row: a long series is never held whole in memory."""
    yield "["
    for i, row in enumerate(rows):
        yield ("," if i else "") + json.dumps(
            {"step": row["step"], "time": row["time"], "values": row["values"]}
        )
    yield "]"
