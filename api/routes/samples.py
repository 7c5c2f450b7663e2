"""A job's stored trajectory samples (controller/trajectory_view.py): a cursor list, per step or all."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Query

from api.body_checks import CheckedRoute
from api.deps import AUTH_ERRORS, INT64_MAX, READ, CallerDep, ServiceDep
from api.errors import documented
from api.views import listing

router = APIRouter(
    prefix="/v1/jobs/{job_id}",
    tags=["job outputs"],
    route_class=CheckedRoute,
    responses={**AUTH_ERRORS, **documented(404)},
)


@router.get("/samples", dependencies=READ)
def samples(
    job_id: str,
    service: ServiceDep,
    caller: CallerDep,
    step: int | None = Query(None, ge=0, le=INT64_MAX, description="only this step's samples"),
    after: int = Query(0, ge=0, le=INT64_MAX, description="cursor: the last sample id of the previous page"),
    limit: int = Query(20, ge=1, le=200),
) -> dict[str, Any]:
    """Each sample: prompt, turns (role, content), reward, finish_reason, token counts, the
    response as spans of trained (sampled) and untrained (observation / template) tokens, and
    `error` where the reward function or the environment failed on it (scored 0.0)."""
    service.get(job_id, caller.sees)
    rows = service.store.samples(job_id, step, after, limit + 1)
    return listing(rows[:limit], len(rows) > limit)
