"""API keys (admin only): make a key for an owner (shown once, in that answer), list keys (never the
key), revoke one (refused from the next request on)."""

from __future__ import annotations

import time
from typing import Any, Literal

from fastapi import APIRouter, Body, Query
from pydantic import BaseModel, ConfigDict, Field, field_validator

from api.auth import hash_token, new_key
from api.body_checks import CheckedRoute
from api.deps import ADMIN, AUTH_ERRORS, BODY_ERRORS, ServiceDep
from api.errors import APIError, documented
from api.views import listing
from service.keys import check_owner, public_key

router = APIRouter(prefix="/v1/keys", tags=["keys"], route_class=CheckedRoute, responses=AUTH_ERRORS)
DAY_S = 86_400.0


class KeyRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    owner: str = Field(..., description="who the key acts for: every job, file and sample it makes is theirs")
    scope: Literal["read", "write"] = Field(
        "write", description="read: look only; write: also submit and steer"
    )
    expires_days: float | None = Field(None, gt=0, le=36_500, description="the key stops working after this")
    name: str = Field("", max_length=128, description="a note on what the key is for")

    @field_validator("owner")
    @classmethod
    def _owner(cls, value: str) -> str:
        return check_owner(value)


@router.post("", status_code=201, dependencies=ADMIN, responses=BODY_ERRORS)
def create_key(service: ServiceDep, body: KeyRequest = Body(...)) -> dict[str, Any]:
    """A new key for `owner`; `key` is in this answer only."""
    key = new_key()
    scopes = ["read", "write"] if body.scope == "write" else ["read"]
    expires = time.time() + body.expires_days * DAY_S if body.expires_days else None
    key_id = service.store.add_token(
        body.name or body.owner, hash_token(key), scopes, body.owner, False, expires
    )
    return {**public_key(service.store.key(key_id)), "key": key}


@router.get("", dependencies=ADMIN)
def list_keys(
    service: ServiceDep, owner: str | None = Query(None, max_length=64, description="only this owner's keys")
) -> dict[str, Any]:
    keys = [public_key(k) for k in service.store.tokens() if owner is None or k["owner"] == owner]
    return listing(keys, False)


@router.delete("/{key_id}", dependencies=ADMIN, responses=documented(404, 409))
def revoke_key(key_id: str, service: ServiceDep) -> dict[str, Any]:
    """Revoke a key: refused from the next request on. Revoking it again is a no-op."""
    record = service.store.key(key_id)
    if record is None:
        raise APIError(404, f"no key '{key_id[:64]}'", "key_id", "not_found")
    if record["admin"]:
        raise APIError(409, f"key '{key_id}' is the admin token: it cannot be revoked here (restart the service "
                       "with a new TANDEM_ADMIN_TOKEN, or its admin_token file deleted, to replace it)", "key_id",
                       "admin_key")  # fmt: skip
    service.store.revoke_key(key_id)
    return public_key(service.store.key(key_id))
