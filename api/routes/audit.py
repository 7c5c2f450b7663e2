"""The audit log (admin only): every accepted write, newest first (api/middleware.py records them)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Query

from api.body_checks import CheckedRoute
from api.deps import ADMIN, AUTH_ERRORS, INT64_MAX, ServiceDep
from api.views import listing

router = APIRouter(prefix="/v1/audit", tags=["audit"], route_class=CheckedRoute, responses=AUTH_ERRORS)


@router.get("", dependencies=ADMIN)
def audit_log(
    service: ServiceDep,
    after: int | None = Query(
        None, ge=1, le=INT64_MAX, description="cursor: the last id of the previous page"
    ),
    limit: int = Query(100, ge=1, le=1000),
    owner: str | None = Query(None, max_length=64, description="only this owner's writes"),
    action: str | None = Query(None, max_length=64, description="only this action, e.g. create_job, cancel"),
    target: str | None = Query(None, max_length=128, description="only writes to this resource id"),
) -> dict[str, Any]:
    """Each entry: time, owner, key_id, action, method, path, target, target_owner, status, request_id,
    data (a small request body, the query string)."""
    rows, more = service.store.audit(after, limit, owner, action, target)
    return listing(rows, more)
