"""The app's ASGI middleware: request ids and latency, and the request body size limit.

Both are plain ASGI (not Starlette's BaseHTTPMiddleware, which runs the app in a task group and
wraps what a route raises while reading its body in an ExceptionGroup).

The body limit answers 413 in the API's error shape (the Tinker SDK's under /api/v1). A declared
Content-Length over the limit is refused before the body is read; a body sent without one (chunked)
is counted as it arrives and refused once it passes the limit. Uploads (POST /v1/files) and Tinker's
forward/forward_backward bodies have their own, larger limits (api/app.py).
"""

from __future__ import annotations

import json
import re
import time
import uuid
from collections.abc import Callable

from fastapi import HTTPException
from prometheus_client import Histogram
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from api.errors import TINKER_PREFIX, error_body, tinker_error_body


class BodyTooLarge(HTTPException):
    """Raised while a route reads its body (FastAPI passes HTTPExceptions through its body parsing)."""

    param, code = "body", "body_too_large"

    def __init__(self, limit: int) -> None:
        super().__init__(413, _message(limit))


def _message(limit: int) -> str:
    return f"the request body is larger than {limit} bytes, the limit of this service"


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
            await _refuse(send, limit, scope["path"])
            return
        received = 0
        started = False

        async def counted() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise BodyTooLarge(limit)
            return message

        async def watched(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counted, watched)
        except BodyTooLarge:
            if not started:
                await _refuse(send, limit, scope["path"])


async def _refuse(send: Send, limit: int, path: str) -> None:
    param, code = BodyTooLarge.param, BodyTooLarge.code
    if path.startswith(TINKER_PREFIX):
        shaped = tinker_error_body(f"{param}: {_message(limit)}", param)
    else:
        shaped = error_body(413, _message(limit), param, code)
    body = json.dumps(shaped).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
               (b"connection", b"close")]  # fmt: skip
    await send({"type": "http.response.start", "status": 413, "headers": headers})
    await send({"type": "http.response.body", "body": body})


# A client's x-request-id is kept (in the response and the audit log) only when it looks like an id:
# anything longer or odder is replaced by a new one, so no client writes what it likes into the log.
CLIENT_REQUEST_ID = re.compile(rb"[A-Za-z0-9][A-Za-z0-9._:@+=/-]{0,127}")


class RequestId:
    """Every response carries x-request-id (the client's when it is an id of at most 128 letters,
    digits and ._:@+=/-, else a new one); latency per route is observed."""

    def __init__(self, app: ASGIApp, latency: Histogram) -> None:
        self.app, self.latency = app, latency

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = dict(scope["headers"]).get(b"x-request-id", b"")
        rid = given if CLIENT_REQUEST_ID.fullmatch(given) else ("req_" + uuid.uuid4().hex[:16]).encode()
        scope.setdefault("state", {})["request_id"] = rid.decode("latin-1")  # the audit log's (api/audit.py)
        start = time.perf_counter()

        async def tagged(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != b"x-request-id"]
                message = {**message, "headers": [*headers, (b"x-request-id", rid)]}
                path = getattr(scope.get("route"), "path", "unmatched")
                self.latency.labels(scope["method"], path, str(message["status"])).observe(
                    time.perf_counter() - start
                )
            await send(message)

        await self.app(scope, receive, tagged)
