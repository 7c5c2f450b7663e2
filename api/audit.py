"""Every write the API accepts goes into the audit log (service/audit.py), recorded here, once, for
every route: a POST, PUT, PATCH or DELETE answered with a 2xx by a route that identified its caller.

Recording in one ASGI layer rather than in each route means a write route added later is audited
without being told to. What a row holds: docs/ARCHITECTURE.md §8.
"""

from __future__ import annotations

import json
from typing import Any

from starlette.concurrency import run_in_threadpool
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service.audit import AuditEntry
from service.store import JobStore

WRITES = frozenset({"POST", "PUT", "PATCH", "DELETE"})
KEPT_BYTES = 4096  # a request or response body longer than this is not kept (or not read for an id)


class AuditTrail:
    def __init__(self, app: ASGIApp, store: JobStore) -> None:
        self.app, self.store = app, store

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] not in WRITES:
            await self.app(scope, receive, send)
            return
        sent: dict[str, Any] = {"status": 0, "body": b"", "json": False}
        request = bytearray()
        is_json = dict(scope["headers"]).get(b"content-type", b"").startswith(b"application/json")

        async def kept_receive() -> Message:
            message = await receive()
            if message["type"] == "http.request" and is_json and len(request) <= KEPT_BYTES:
                request.extend(message.get("body", b"")[: KEPT_BYTES + 1])
            return message

        async def watched(message: Message) -> None:
            if message["type"] == "http.response.start":
                sent["status"] = message["status"]
                sent["json"] = any(k == b"content-type" and v.startswith(b"application/json")
                                   for k, v in message.get("headers", []))  # fmt: skip
            elif message["type"] == "http.response.body":
                if len(sent["body"]) <= KEPT_BYTES * 16:
                    sent["body"] += message.get("body", b"")
                if not message.get("more_body", False):  # recorded before the client has the answer
                    await self._record(scope, sent, bytes(request))
            await send(message)

        await self.app(scope, kept_receive, watched)

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
