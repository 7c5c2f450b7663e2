"""What every Tinker API route shares: the caller, its answers, and the SDK's error shape.

The official SDK reads a failure as `{"error": str, "category": "user"|"server"|"unknown"}`
(`tinker/types/request_failed_response.py`); Tandem adds `param`, the field at fault. Statuses are
chosen for the SDK's retry rules (`InternalClientHolder._is_retryable_status_code`): a refusal is a
400/404/429, never a 5xx or 408/409, which the SDK would retry for minutes instead of showing.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from api.auth import Caller
from api.errors import tinker_error_body
from service.tinker_service import TinkerError, TinkerService


def install_tinker_errors(app: FastAPI) -> None:
    @app.exception_handler(TinkerError)
    async def _tinker_error(request: Request, err: TinkerError) -> JSONResponse:
        return JSONResponse(tinker_error_body(err.message, err.field, err.category), err.status)


def tinker(request: Request) -> TinkerService:
    return request.app.state.tinker


async def caller(request: Request, scope: str = "write") -> Caller:
    return await request.app.state.auth.require(request, scope)


def future_answer(future: Any, **extra: Any) -> dict[str, Any]:
    """An `UntypedAPIFuture`: what every queued piece of work answers at once."""
    return {"request_id": future.id, **{k: v for k, v in extra.items() if v is not None}}
