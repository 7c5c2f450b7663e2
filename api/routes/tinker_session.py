"""Tinker API: client configuration, sessions, heartbeats, capabilities, futures, a 400 naming any
other call as unsupported, and what every Tinker route shares. A refusal is the SDK's `{"error",
"category"}` plus `param`, the field at fault; never a 5xx, 408 or 409, which the SDK retries instead
of showing."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any, TypeVar

import anyio
from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response

from api.auth import Caller
from api.errors import tinker_error_body
from api.tinker_bodies import parsed
from service.tinker_checkpoints import not_found
from service.tinker_requests import MAX_TAGS, CreateSession, FutureRef, SessionRef
from service.tinker_service import TinkerError, TinkerService

router = APIRouter(prefix="/api/v1", tags=["tinker"], include_in_schema=False)  # the SDK's protocol
# retrieve_future waits this long before `try_again`, well within the SDK's read timeout for it (45 s)
LONG_POLL_S = 10.0
T = TypeVar("T")

# The SDK's feature flags (tinker/types/client_config_response.py): plain API keys, httpx, protobuf
# forward_backward in chunks, per-request future polling, client-side custom losses.
CLIENT_CONFIG = {
    "pjwt_auth_enabled": False,
    "credential_default_source": "api_key",
    "use_pyqwest_transport": False,
    "proto_compress_fwdbwd": False,
    "sample_use_retrieve_futures": False,
    "custom_loss_server_side": False,
    "sample_join_sampling_session": False,
    "fwdbwd_max_chunk_len": 1024,
    "fwdbwd_max_chunk_bytes_count": 5_000_000,  # the chunk size the body caps are sized from (api/settings.py)
}
DYNAMIC_CONFIG = {
    "refresh_interval_sec": 300,
    "sample_cancel_enabled": True,
    "sample_cancel_max_batch_size": 64,
}


def install_tinker_errors(app: FastAPI) -> None:
    @app.exception_handler(TinkerError)
    async def _tinker_error(request: Request, err: TinkerError) -> JSONResponse:
        return JSONResponse(tinker_error_body(err.message, err.field, err.category), err.status)


async def in_thread(work: Callable[..., T], *args: Any) -> T:
    """Service work that may wait on a lock, the store or the disk: long polls are answered meanwhile."""
    return await anyio.to_thread.run_sync(work, *args)


def tinker(request: Request) -> TinkerService:
    return request.app.state.tinker


async def caller(request: Request, scope: str = "write") -> Caller:
    return await request.app.state.auth.require(request, scope)


def future_answer(future: Any, **extra: Any) -> dict[str, Any]:
    """An `UntypedAPIFuture`: what every queued piece of work answers at once."""
    return {"request_id": future.id, **{k: v for k, v in extra.items() if v is not None}}


@router.post("/client/config", include_in_schema=False)
async def client_config(request: Request) -> dict[str, Any]:
    await caller(request, "read")
    return CLIENT_CONFIG


@router.post("/client/dynamic_config", include_in_schema=False)
async def client_dynamic_config(request: Request) -> dict[str, Any]:
    await caller(request, "read")
    return DYNAMIC_CONFIG


@router.get("/healthz", include_in_schema=False)
async def healthz() -> dict[str, str]:
    return {"status": "ok"}


@router.get("/get_server_capabilities", summary="Tinker: the base models served here")
async def capabilities(request: Request) -> dict[str, Any]:
    await caller(request, "read")
    return tinker(request).capabilities()


@router.post("/create_session", summary="Tinker: start a client session")
async def create_session(request: Request) -> dict[str, Any]:
    who = await caller(request)
    body = await parsed(request, CreateSession)
    session = await in_thread(tinker(request).create_session, who.owner, body.tags[:MAX_TAGS])
    return {"type": "create_session", "session_id": session.id}


@router.post("/session_heartbeat", summary="Tinker: keep a client session alive")
async def heartbeat(request: Request) -> dict[str, Any]:
    who = await caller(request)
    svc = tinker(request)
    await in_thread(svc.expire_sessions)
    session = svc.session((await parsed(request, SessionRef)).session_id, who.sees)
    session.last_heartbeat = time.time()
    return {"type": "session_heartbeat"}


@router.post("/sessions/{session_id}/finish", include_in_schema=False)
async def finish_session(request: Request, session_id: str) -> dict[str, Any]:
    who = await caller(request)
    tinker(request).session(session_id, who.sees)
    return {}


@router.get("/sessions", summary="Tinker: the caller's client sessions")
async def list_sessions(request: Request) -> dict[str, Any]:
    who = await caller(request, "read")
    records = tinker(request).records
    return {"sessions": [s.id for s in list(records.sessions.values()) if who.sees in (None, s.owner)]}


@router.get("/sessions/{session_id}", summary="Tinker: one client session")
async def get_session(request: Request, session_id: str) -> dict[str, Any]:
    who = await caller(request, "read")
    svc = tinker(request)
    session = svc.session(session_id, who.sees)
    models = [m for m in list(svc.records.models.values()) if m.session_id == session.id]
    samplers = [s.id for s in list(svc.records.samplers.values()) if s.id.startswith(session.id + ":")]
    return {"training_run_ids": [m.job_id for m in models], "sampler_ids": samplers}


async def _future(request: Request) -> Any:
    """The caller's future named by the body's request_id; another owner's is a 404 like an unknown one."""
    who = await caller(request)
    request_id = (await parsed(request, FutureRef)).request_id
    future = tinker(request).futures.get(request_id, who.sees)
    if future is None:
        raise not_found("future", request_id, "request_id")
    return future


@router.post("/retrieve_future", summary="Tinker: a future's result, or try_again")
async def retrieve_future(request: Request) -> Any:
    future = await _future(request)
    deadline, pause = time.monotonic() + LONG_POLL_S, 0.005
    while not future.done and time.monotonic() < deadline:
        await asyncio.sleep(pause)
        pause = min(pause * 1.5, 0.05)
    if not future.done:
        return {"type": "try_again", "request_id": future.id, "queue_state": "active"}
    if isinstance(future.answer, bytes):
        return Response(future.answer, media_type="application/x-protobuf")
    return future.answer


@router.post("/cancel_future", summary="Tinker: cancel a queued request")
async def cancel_future(request: Request) -> dict[str, Any]:
    return {"cancelled": tinker(request).futures.cancel(await _future(request))}


@router.post("/telemetry", include_in_schema=False)
async def telemetry(request: Request) -> dict[str, str]:
    await caller(request)
    return {"status": "accepted"}  # the SDK's telemetry is accepted and dropped: nothing leaves the machine


fallback = APIRouter()  # registered after every Tinker route


@fallback.api_route(
    "/api/v1/{rest:path}", methods=["GET", "POST", "PUT", "PATCH", "DELETE"], include_in_schema=False
)
async def unsupported(request: Request, rest: str) -> JSONResponse:
    """Anything else under /api/v1 is named and refused at once."""
    await caller(request, "read")
    message = (f"unsupported feature: {request.method} /api/v1/{rest} is a Tinker API call that Tandem does "
               "not serve (docs/tinker.md lists what is compatible)")  # fmt: skip
    return JSONResponse(tinker_error_body(message, rest.split("/")[0]), 400)
