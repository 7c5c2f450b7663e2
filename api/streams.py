"""Server-Sent Events over the store's append-only tables (a row's id is its SSE id, so Last-Event-ID
resumes), with heartbeats when idle and an `end` event once the job is terminal and all is sent.
Each live stream polls the store, so an owner holds at most MAX_STREAMS_PER_OWNER at once, and checks
its key at every poll: a key revoked or expired ends its streams within a poll."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from functools import partial

from fastapi import APIRouter, Header, Query, Request
from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from api.deps import INT64_MAX, READ, CallerDep, ServiceDep
from api.errors import APIError, documented
from service.store import TERMINAL, JobStore

POLL_S = 0.5
HEARTBEAT_S = 15.0
HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
MAX_STREAMS_PER_OWNER = 32  # a dashboard follows three per job page


class StreamSlots:
    """The live streams each owner holds: one past the bound is a 429 until one closes."""

    def __init__(self, most: int = MAX_STREAMS_PER_OWNER) -> None:
        self.most, self.held, self._lock = most, Counter[str](), threading.Lock()

    def take(self, owner: str) -> None:
        with self._lock:
            if self.held[owner] >= self.most:
                why = f"'{owner}' holds {self.most} live streams, the most one owner may; close one first"
                raise APIError(429, why, "stream", "too_many_streams", {"Retry-After": "5"})
            self.held[owner] += 1

    def give_back(self, owner: str) -> None:
        with self._lock:
            self.held[owner] -= 1


class SlotStream(StreamingResponse):
    """A stream that gives its owner's slot back however it ends (sent, disconnected, failed)."""

    def __init__(self, rows: AsyncIterator[str], release: Callable[[], None]) -> None:
        super().__init__(rows, media_type="text/event-stream", headers=HEADERS)
        self.release = release

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.release()


def stream_route(
    router: APIRouter,
    path: str,
    name: str,
    reads: str,
    limit: int,
    event: str | Callable[[dict], str],
    most: int = INT64_MAX,
) -> None:
    """A GET route streaming a job's rows live: the store's `reads(job_id, after_id=, limit=)`, each an
    SSE `event` (a name, or the name a row gives). `?after=` or Last-Event-ID is where it resumes."""

    @router.get(path, name=name, dependencies=READ, responses=documented(429))
    def stream(
        request: Request,
        job_id: str,
        service: ServiceDep,
        caller: CallerDep,
        after: int = Query(0, ge=0, le=most),
        last_event_id: int | None = Header(
            None, ge=0, le=most, description="the last id a reconnecting client had; it replaces `after`"
        ),
    ):
        service.get(job_id, caller.sees)
        start = after if last_event_id is None else last_event_id
        fetch = partial(getattr(service.store, reads), job_id, limit=limit)
        slots: StreamSlots = request.app.state.streams
        slots.take(caller.owner)
        rows = _events(request, service.store, job_id, fetch, event, start)
        return SlotStream(rows, partial(slots.give_back, caller.owner))


async def _events(
    request: Request,
    store: JobStore,
    job_id: str,
    fetch: Callable[..., list[dict]],
    event: str | Callable[[dict], str],
    last: int,
) -> AsyncIterator[str]:
    idle_since = time.monotonic()
    while True:
        # A key revoked (or expired) while its stream is open ends it here; the client's reconnect is a 401.
        if await request.is_disconnected() or await request.app.state.auth.current(request) is None:
            return
        rows = await asyncio.to_thread(fetch, after_id=last)
        for row in rows:
            last = row["id"]
            name = event if isinstance(event, str) else event(row)
            yield f"id: {last}\nevent: {name}\ndata: {json.dumps(row, default=str)}\n\n"
        if rows:
            idle_since = time.monotonic()
            continue
        job = await asyncio.to_thread(store.get_job, job_id)
        if job is None or job.status in TERMINAL:
            final = await asyncio.to_thread(fetch, after_id=last)
            if not final:
                yield f"event: end\ndata: {json.dumps({'status': job.status if job else 'deleted'})}\n\n"
                return
            continue
        if time.monotonic() - idle_since > HEARTBEAT_S:
            idle_since = time.monotonic()
            yield ": heartbeat\n\n"
        await asyncio.sleep(POLL_S)
