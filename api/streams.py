"""Server-Sent Events over the store's append-only tables (a row's id is its SSE id, so Last-Event-ID
resumes), with heartbeats when idle and an `end` event once the job is terminal and all is sent."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from functools import partial

from fastapi import APIRouter, Query, Request
from fastapi.responses import StreamingResponse

from api.deps import INT64_MAX, READ, CallerDep, ServiceDep
from service.store import TERMINAL, JobStore

POLL_S = 0.5
HEARTBEAT_S = 15.0
HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


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

    @router.get(path, name=name, dependencies=READ)
    def stream(
        request: Request,
        job_id: str,
        service: ServiceDep,
        caller: CallerDep,
        after: int = Query(0, ge=0, le=most),
    ):
        service.get(job_id, caller.sees)
        header = request.headers.get("last-event-id")
        start = int(header) if header and header.isdigit() else after
        fetch = partial(getattr(service.store, reads), job_id, limit=limit)
        rows = _events(request, service.store, job_id, fetch, event, start)
        return StreamingResponse(rows, media_type="text/event-stream", headers=HEADERS)


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
        if await request.is_disconnected():
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
