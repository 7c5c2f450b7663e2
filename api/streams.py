"""Server-Sent Events over the store's append-only tables (a row's id is its SSE id, so Last-Event-ID
resumes), with heartbeats when idle and an `end` event once the job is terminal and all is sent."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable

from fastapi import Request
from fastapi.responses import StreamingResponse

from service.store import TERMINAL, JobStore

POLL_S = 0.5
HEARTBEAT_S = 15.0


def start_id(request: Request, after: int | None) -> int:
    header = request.headers.get("last-event-id")
    if header and header.isdigit():
        return int(header)
    return after or 0


def sse(
    request: Request,
    store: JobStore,
    job_id: str,
    fetch: Callable[[int], list[dict]],
    event_name: Callable[[dict], str],
    after: int,
) -> StreamingResponse:
    async def generate() -> AsyncIterator[str]:
        last, idle_since = after, time.monotonic()
        while True:
            if await request.is_disconnected():
                return
            rows = await asyncio.to_thread(fetch, last)
            for row in rows:
                last = row["id"]
                yield f"id: {last}\nevent: {event_name(row)}\ndata: {json.dumps(row, default=str)}\n\n"
            if rows:
                idle_since = time.monotonic()
                continue
            job = await asyncio.to_thread(store.get_job, job_id)
            if job is None or job.status in TERMINAL:
                final = await asyncio.to_thread(fetch, last)
                if not final:
                    yield f"event: end\ndata: {json.dumps({'status': job.status if job else 'deleted'})}\n\n"
                    return
                continue
            if time.monotonic() - idle_since > HEARTBEAT_S:
                idle_since = time.monotonic()
                yield ": heartbeat\n\n"
            await asyncio.sleep(POLL_S)

    headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    return StreamingResponse(generate(), media_type="text/event-stream", headers=headers)
