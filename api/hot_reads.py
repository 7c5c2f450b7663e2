"""Repeated hot GETs (the job list, a job's metrics) answered from the read cache before FastAPI sees
them: solving a route's dependencies costs far more CPU than the cached answer.

A GET is answered here only when the route itself answered the same path and query for the same
viewer before (so FastAPI validated them and named the cached page, `HotReads.answer`) and the key
is in the cached key table with the read scope. Anything else, including a read that fails, goes to
FastAPI, so validation, auth and read errors are FastAPI's, and a hit's body is the route's own
rendering.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any

from fastapi import Request, Response
from starlette.types import ASGIApp, Receive, Scope, Send

from api.auth import Authenticator
from api.read_cache import MISSING, ReadCache
from api.views import json_response

Render = Callable[[Any], bytes]


@dataclass(frozen=True)
class Learned:
    """A cached page, its topic, and how the route reads and renders it."""

    key: Hashable
    topic: str
    read: Callable[[], Any]
    render: Render
    route: Any  # the matched APIRoute: the latency metric's label


class HotReads:
    """The table of learned queries, and the check that answers one without FastAPI."""

    def __init__(self, cache: ReadCache, auth: Authenticator, max_queries: int = 4096) -> None:
        self.cache, self.auth, self.max_queries = cache, auth, max_queries
        self._learned: dict[tuple[str, bytes, str | None], Learned] = {}
        # (path, query) learned for some viewer: a GET of any other goes on to FastAPI unchecked
        self._queries: set[tuple[str, bytes]] = set()
        self.hits = 0  # requests answered here, for tests and benchmarks

    async def answer(
        self, request: Request, key: Hashable, topic: str, read: Callable[[], Any], render: Render
    ) -> Response:
        """A route's answer: the cached value (read on a miss), rendered; the query is learned."""
        value = await self.cache.get(key, topic, read)
        where = (request.scope["path"], request.scope["query_string"], request.state.caller.sees)
        if where not in self._learned and len(self._learned) >= self.max_queries:
            del self._learned[next(iter(self._learned))]  # the oldest learned
        self._learned[where] = Learned(key, topic, read, render, request.scope.get("route"))
        if len(self._queries) >= 2 * self.max_queries:  # forget the evicted ones now and then
            self._queries = {(path, query) for path, query, _ in self._learned}
        self._queries.add(where[:2])
        return json_response(render(value))

    async def hit(self, scope: Scope) -> bytes | None:
        """The body to send for this request, or None to let FastAPI answer it."""
        if scope["method"] != "GET" or (scope["path"], scope["query_string"]) not in self._queries:
            return None
        caller = self.auth.cached_caller(scope["headers"])
        if caller is MISSING or caller is None or "read" not in caller.scopes:
            return None
        learned = self._learned.get((scope["path"], scope["query_string"], caller.sees))
        if learned is None:
            return None
        value = self.cache.peek(learned.key, learned.topic)
        if value is MISSING:
            try:
                value = await self.cache.get(learned.key, learned.topic, learned.read)
            except Exception:
                return None  # FastAPI reads again and answers the error as the route does
        scope["route"] = learned.route
        self.hits += 1
        return learned.render(value)


class HotReadPath:
    """ASGI middleware: answers what `HotReads.hit` can, passes the rest on."""

    def __init__(self, app: ASGIApp, hot: HotReads) -> None:
        self.app, self.hot = app, hot

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        body = await self.hot.hit(scope) if scope["type"] == "http" else None
        if body is None:
            await self.app(scope, receive, send)
            return
        # the headers of json_response's Response, in its order
        headers = [(b"content-length", str(len(body)).encode()), (b"content-type", b"application/json")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": body})
