"""What the hot read routes computed, kept until the store's next write to its topic
(`JobStore.changes`): dashboards poll far more often than a job writes.

Requests that miss together share one read (a write during it leaves the entry stale on arrival).
Values are treated as immutable; entries are bounded in number and bytes, least recently used first out.

`HotReads` answers a repeated GET from it before FastAPI sees it (solving a route's dependencies costs far
more CPU than the answer), but only a path and query the route itself answered for the same viewer (so
FastAPI validated them) and whose token is cached with the read scope; anything else, a failed read
too, goes on to FastAPI.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fastapi import Request, Response
from starlette.concurrency import run_in_threadpool
from starlette.types import ASGIApp, Receive, Scope, Send

from api.views import json_response
from service.store import JobStore

if TYPE_CHECKING:
    from api.auth import Authenticator

MISSING = object()  # peek's answer when nothing valid is cached


class ReadCache:
    def __init__(self, store: JobStore, max_entries: int = 256, max_bytes: int = 64 << 20) -> None:
        self.store = store
        self.max_entries, self.max_bytes = max_entries, max_bytes
        # key -> (changes of its topic when it was read, value, size in bytes)
        self._entries: OrderedDict[Hashable, tuple[int, Any, int]] = OrderedDict()
        self._bytes = 0
        self._reading: dict[tuple[Hashable, int], asyncio.Task] = {}
        self.reads = 0  # reads made (misses), for benchmarks

    def peek(self, key: Hashable, topic: str) -> Any:
        """The value cached under `key` while `topic` is unchanged since it was read, else MISSING."""
        entry = self._entries.get(key)
        if entry is None or entry[0] != self.store.changes(topic):
            return MISSING
        self._entries.move_to_end(key)
        return entry[1]

    async def get(self, key: Hashable, topic: str, read: Callable[[], Any]) -> Any:
        """The value cached under `key` while `topic`'s rows are unchanged, else `read()`'s (in a thread)."""
        value = self.peek(key, topic)
        if value is not MISSING:
            return value
        version = self.store.changes(topic)
        task = self._reading.get((key, version))
        if task is None:
            task = asyncio.ensure_future(self._read(key, version, read))
            task.add_done_callback(_retrieve)
            self._reading[(key, version)] = task
        # shielded: a client that goes away does not cancel the read the others wait for
        return await asyncio.shield(task)

    async def _read(self, key: Hashable, version: int, read: Callable[[], Any]) -> Any:
        self.reads += 1
        try:
            value = await run_in_threadpool(read)
        finally:
            del self._reading[(key, version)]
        self._put(key, version, value)
        return value

    def _put(self, key: Hashable, version: int, value: Any) -> None:
        size = len(value) if isinstance(value, bytes) else 0
        if size > self.max_bytes // 4:
            return  # one huge page would push out everything else
        old = self._entries.pop(key, None)
        if old is not None:
            self._bytes -= old[2]
        self._entries[key] = (version, value, size)
        self._bytes += size
        while len(self._entries) > self.max_entries or self._bytes > self.max_bytes:
            _, (_, _, dropped) = self._entries.popitem(last=False)
            self._bytes -= dropped


def _retrieve(task: asyncio.Task) -> None:
    """A read whose every requester went away: its error is theirs, not an unretrieved one."""
    if not task.cancelled():
        task.exception()


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

    def middleware(self, app: ASGIApp) -> ASGIApp:
        """ASGI middleware: answers what `hit` can, passes the rest on to `app`."""

        async def hot_path(scope: Scope, receive: Receive, send: Send) -> None:
            body = await self.hit(scope) if scope["type"] == "http" else None
            await (app if body is None else json_response(body))(scope, receive, send)

        return hot_path
