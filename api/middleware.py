"""The app's ASGI middleware: request ids and latency, the request body limits (413 before a declared
Content-Length is read, or once a chunked body passes it; 408 once a body pauses longer than
BODY_IDLE_S, so a client that never finishes one holds no request for ever), and the audit trail: every write a
route accepted from an identified caller is recorded here, once, so a write route added later is
audited without being told to.

Plain ASGI: Starlette's BaseHTTPMiddleware would wrap what a route raises while reading its body in an
ExceptionGroup.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
import uuid
from collections.abc import Callable
from typing import Any

from fastapi import HTTPException
from fastapi.responses import JSONResponse
from prometheus_client import Histogram
from starlette.concurrency import run_in_threadpool
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from api.errors import TINKER_PREFIX, error_json
from service.store import JobStore
from service.store_outputs import AuditEntry

BODY_IDLE_S = 30.0  # the longest a request body may pause between two of its chunks


class BodyRefused(HTTPException):
    """Raised while a route reads its body (FastAPI passes HTTPExceptions through its body parsing)."""

    param = "body"

    def __init__(self, status: int, message: str, code: str) -> None:
        super().__init__(status, message)
        self.code = code


def too_large(limit: int) -> BodyRefused:
    why = f"the request body is larger than {limit} bytes, the limit of this service"
    return BodyRefused(413, why, "body_too_large")


def stalled(idle_s: float) -> BodyRefused:
    why = f"the request body paused for more than {idle_s:g} s before it was complete; send it whole"
    return BodyRefused(408, why, "body_timeout")


class BodyLimit:
    def __init__(self, app: ASGIApp, limit_for: Callable[[Scope], int]) -> None:
        self.app, self.limit_for = app, limit_for

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.limit_for(scope)
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            await _refuse(scope, receive, send, too_large(limit))
            return
        received = 0
        started = complete = False

        async def counted() -> Message:
            nonlocal received, complete
            if complete:  # what follows the body is the client's disconnect, which may come whenever
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), BODY_IDLE_S)
            except TimeoutError:
                raise stalled(BODY_IDLE_S) from None
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                complete = not message.get("more_body", False)
                if received > limit:
                    raise too_large(limit)
            return message

        async def watched(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counted, watched)
        except BodyRefused as refused:
            if not started:
                await _refuse(scope, receive, send, refused)


async def _refuse(scope: Scope, receive: Receive, send: Send, refused: BodyRefused) -> None:
    param, code, why = refused.param, refused.code, str(refused.detail)
    tinker = scope["path"].startswith(TINKER_PREFIX)  # the SDK's message names the field itself
    message = f"{param}: {why}" if tinker else why
    status, body = error_json(scope["path"], refused.status_code, message, param, code)
    await JSONResponse(body, status, headers={"connection": "close"})(scope, receive, send)


# A client's x-request-id is kept (in the response and the audit log) only when it looks like an id:
# anything longer or odder is replaced by a new one, so no client writes what it likes into the log.
CLIENT_REQUEST_ID = re.compile(rb"[A-Za-z0-9][A-Za-z0-9._:@+=/-]{0,127}")
WRITES = frozenset({"POST", "PUT", "PATCH", "DELETE"})  # audited
KEPT_BYTES = 4096  # a request or response body longer than this is not kept (or not read for an id)


class RequestLog:
    """Every response carries x-request-id (the client's when it looks like an id, else a new one);
    latency per route is observed; every write a route accepted from an identified caller is audited."""

    def __init__(self, app: ASGIApp, latency: Histogram, store: JobStore) -> None:
        self.app, self.latency, self.store = app, latency, store

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        given = headers.get(b"x-request-id", b"")
        rid = given if CLIENT_REQUEST_ID.fullmatch(given) else ("req_" + uuid.uuid4().hex[:16]).encode()
        scope.setdefault("state", {})["request_id"] = rid.decode("latin-1")  # the audit trail's
        start = time.perf_counter()
        audited = scope["method"] in WRITES
        sent: dict[str, Any] = {"status": 0, "body": b"", "json": False}
        request = bytearray()
        is_json = headers.get(b"content-type", b"").startswith(b"application/json")

        async def kept_receive() -> Message:
            message = await receive()
            if message["type"] == "http.request" and is_json and len(request) <= KEPT_BYTES:
                request.extend(message.get("body", b"")[: KEPT_BYTES + 1])
            return message

        async def tagged(message: Message) -> None:
            if message["type"] == "http.response.start":
                sent["status"] = message["status"]
                sent["json"] = any(k == b"content-type" and v.startswith(b"application/json")
                                   for k, v in message.get("headers", []))  # fmt: skip
                kept = [(k, v) for k, v in message.get("headers", []) if k.lower() != b"x-request-id"]
                message = {**message, "headers": [*kept, (b"x-request-id", rid)]}
                path = getattr(scope.get("route"), "path", "unmatched")
                self.latency.labels(scope["method"], path, str(message["status"])).observe(
                    time.perf_counter() - start
                )
            elif message["type"] == "http.response.body" and audited:
                if len(sent["body"]) <= KEPT_BYTES * 16:
                    sent["body"] += message.get("body", b"")
                if not message.get("more_body", False):  # recorded before the client has the answer
                    await self._record(scope, sent, bytes(request))
            await send(message)

        await self.app(scope, kept_receive if audited else receive, tagged)

    async def _record(self, scope: Scope, sent: dict[str, Any], request: bytes) -> None:
        caller = scope.get("state", {}).get("caller")
        if caller is not None and 200 <= sent["status"] < 300:
            await run_in_threadpool(self.store.add_audit, _entry(scope, caller, sent, request))


def _entry(scope: Scope, caller: Any, sent: dict[str, Any], request: bytes) -> AuditEntry:
    answer = _json(sent["body"]) if sent["json"] else None
    answer = answer if isinstance(answer, dict) else {}
    params = scope.get("path_params") or {}
    target = next(iter(params.values()), None) or answer.get("id")
    body = _json(request) if 0 < len(request) <= KEPT_BYTES else None
    data: dict[str, Any] = {"body": body} if body is not None else {}
    if scope.get("query_string"):
        data["query"] = scope["query_string"].decode("latin-1")[:512]
    route = scope.get("route")
    return AuditEntry(
        owner=caller.owner,
        key_id=caller.key_id,
        action=getattr(route, "name", "unknown"),
        method=scope["method"],
        path=scope["path"][:512],
        target=str(target)[:128] if target is not None else None,
        target_owner=answer.get("owner") if isinstance(answer.get("owner"), str) else None,
        status=sent["status"],
        request_id=scope.get("state", {}).get("request_id", ""),
        data=data,
    )


def _json(raw: bytes) -> Any:
    try:
        return json.loads(raw)
    except ValueError:
        return None
