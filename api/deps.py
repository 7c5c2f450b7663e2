"""What every route depends on: the Service behind the app (through `request.app.state`), the token
scope it requires, and the caller."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Annotated, Any

from fastapi import Depends, Query, Request, Security
from fastapi.security import HTTPBearer

from api.auth import Caller
from api.errors import documented
from api.read_cache import HotReads
from api.validation import Checker
from service.service import Service


class TokenScope(HTTPBearer):
    """A route's token check, declared as FastAPI's bearer scheme so that the OpenAPI document carries it.
    The check is the Authenticator's: HTTPBearer's own would build a credentials model per request."""

    def __init__(self, scope: str) -> None:
        super().__init__(
            auto_error=False,
            scheme_name="HTTPBearer",
            description="a key with the route's scope: $TANDEM_HOME/admin_token, or one from `tandem keys create`",
        )
        self.scope = scope

    async def __call__(self, request: Request) -> None:
        await request.app.state.auth.require(request, self.scope)


INT64_MAX = 2**63 - 1  # SQLite's integers; larger query values are a 422, not a storage error


def app_state(name: str) -> Callable[[Request], Awaitable[Any]]:
    """A dependency on `request.app.state.<name>`. Async, though it does not wait: FastAPI runs a plain
    function dependency in its thread pool, a thread hop per dependency per request."""

    async def get(request: Request) -> Any:
        return getattr(request.app.state, name)

    return get


async def get_caller(request: Request) -> Caller:
    return request.state.caller  # set by the route's TokenScope, which FastAPI solves first


ServiceDep = Annotated[Service, Depends(app_state("service"))]
HotReadsDep = Annotated[HotReads, Depends(app_state("hot_reads"))]
CheckerDep = Annotated[Checker, Depends(app_state("checker"))]
CallerDep = Annotated[Caller, Depends(get_caller)]
# a list's owner filter: an admin's choice (None: everyone's); any other caller sees its own only
OwnerQuery = Annotated[
    str | None, Query(max_length=64, description="admins: only this owner's (others see their own only)")
]
READ = [Security(TokenScope("read"))]
WRITE = [Security(TokenScope("write"))]
ADMIN = [Security(TokenScope("admin"))]  # the admin token only
AUTH_ERRORS = documented(401, 403, 422)
BODY_ERRORS = documented(400, 413)
