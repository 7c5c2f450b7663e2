"""What each owner uses against its quotas, and the quotas themselves (admin: read them, change one
owner's or the default live)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Body

from api.body_checks import CheckedRoute
from api.deps import ADMIN, AUTH_ERRORS, BODY_ERRORS, READ, CallerDep, OwnerQuery, ServiceDep
from api.errors import invalid
from api.views import listing
from service.keys import check_owner
from service.quotas import Quota

router = APIRouter(tags=["usage and quotas"], route_class=CheckedRoute, responses=AUTH_ERRORS)
DEFAULT = "default"  # PUT /v1/quotas/default changes the default quota


@router.get("/v1/usage", dependencies=READ)
def owner_usage(service: ServiceDep, caller: CallerDep, owner: OwnerQuery = None) -> dict[str, Any]:
    """Per owner: jobs running and queued, CPUs and GPUs held, bytes stored (files, checkpoints,
    exports), and its quota. The caller's own; an admin's: every owner's, or `owner`'s."""
    shown = [caller.viewing(owner)] if caller.viewing(owner) else service.owners()
    return listing([service.usage(o).view(service.quotas.of(o)) for o in shown], False)


@router.get("/v1/quotas", dependencies=ADMIN)
def quotas(service: ServiceDep) -> dict[str, Any]:
    """The default quota (every owner's but the admin's) and the owners whose quota replaces it."""
    return {"object": "quotas", **service.quotas.view()}


@router.put("/v1/quotas/{owner}", dependencies=ADMIN, responses=BODY_ERRORS)
def set_quota(owner: str, service: ServiceDep, body: Quota = Body(...)) -> dict[str, Any]:
    """Replace an owner's quota (`default`: the default), from the next request on; fields left
    out are unlimited. Lasts until the service restarts (the serve flags and file set the start)."""
    service.quotas.set(None if owner == DEFAULT else _owner(owner), body)
    return {"object": "quotas", "owner": owner, **service.quotas.view()}


@router.delete("/v1/quotas/{owner}", dependencies=ADMIN)
def reset_quota(owner: str, service: ServiceDep) -> dict[str, Any]:
    """An owner back on the default quota (`default`: the default back to unlimited)."""
    service.quotas.set(None if owner == DEFAULT else _owner(owner), None)
    return {"object": "quotas", "owner": owner, **service.quotas.view()}


def _owner(name: str) -> str:
    try:
        return check_owner(name)
    except ValueError as err:
        raise invalid("owner", str(err).removeprefix("owner: ")) from None
