"""What a job produced: its events and logs (pages and live SSE streams), checkpoints and stored
trajectory samples (its metrics: api/routes/metrics.py)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Query

from api.body_checks import CheckedRoute
from api.deps import AUTH_ERRORS, INT64_MAX, READ, WRITE, CallerDep, ServiceDep
from api.errors import documented
from api.streams import stream_route
from api.views import listing

router = APIRouter(
    prefix="/v1/jobs/{job_id}",
    tags=["job outputs"],
    route_class=CheckedRoute,
    responses={**AUTH_ERRORS, **documented(404)},
)


@router.get("/events", dependencies=READ)
def events(
    job_id: str,
    service: ServiceDep,
    caller: CallerDep,
    after: int = Query(0, ge=0, le=INT64_MAX),
    limit: int = Query(100, ge=1, le=1000),
) -> dict[str, Any]:
    service.get(job_id, caller.sees)
    rows = service.store.events(job_id, after, limit + 1)
    return listing(rows[:limit], len(rows) > limit)


stream_route(router, "/events/stream", "events_stream", "events", 200, lambda row: row["kind"])


@router.get("/logs", dependencies=READ)
def logs(
    job_id: str, service: ServiceDep, caller: CallerDep, tail: int = Query(200, ge=1, le=10_000)
) -> dict[str, Any]:
    service.get(job_id, caller.sees)
    return listing(service.store.logs(job_id, tail=tail), False)


stream_route(router, "/logs/stream", "logs_stream", "logs", 500, "log")


@router.get("/checkpoints", dependencies=READ)
def checkpoints(job_id: str, service: ServiceDep, caller: CallerDep) -> dict[str, Any]:
    return listing(service.checkpoint_dirs(job_id, caller.sees), False)


@router.post("/checkpoints", status_code=202, dependencies=WRITE, responses=documented(409))
def checkpoint_now(job_id: str, service: ServiceDep, caller: CallerDep) -> dict[str, Any]:
    service.checkpoint_now(job_id, caller.sees)
    return {"id": job_id, "object": "checkpoint_request", "status": "requested"}


@router.get("/samples", dependencies=READ)
def samples(
    job_id: str,
    service: ServiceDep,
    caller: CallerDep,
    step: int | None = Query(None, ge=0, le=INT64_MAX, description="only this step's samples"),
    after: int = Query(0, ge=0, le=INT64_MAX, description="cursor: the last sample id of the previous page"),
    limit: int = Query(20, ge=1, le=200),
) -> dict[str, Any]:
    """Each sample: prompt, turns, reward, finish_reason, token counts, the response as spans of trained
    and untrained tokens, and `error` where the reward function or the environment failed on it (such a
    sample has reward null and trains no token)."""
    service.get(job_id, caller.sees)
    rows = service.store.samples(job_id, step, after, limit + 1)
    return listing(rows[:limit], len(rows) > limit)
