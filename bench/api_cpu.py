"""CPU per request of the hot read routes inside the API process, without a server or a client.

    python bench/api_cpu.py                     # 300-step series, 20 jobs, 4000 requests per round
    python bench/api_cpu.py --writes-per-s 8    # a writer thread adds metrics rows as a training job does

The app is built over a real Service and store (temp home, no scheduler, no Ray) and called as uvicorn
calls it (one ASGI call per request, the token in the header), alternating GET /v1/jobs?limit=20 and
GET /v1/jobs/{id}/metrics?max_points=300, bench/load.py's two routes. With --writes-per-s a thread
writes metrics rows to the series at that rate, as the scheduler does beside a training job; a row
changes both pages. Prints one JSON line per round: CPU ms per request (this process: the app, the
writer), the share of requests the read cache answered, and the rows written. What uvicorn and the
network add is not in it (bench/load.py measures the whole service).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import threading
import time
from pathlib import Path

import uvloop

from api.app import create_app
from api.auth import ensure_admin_token
from schema.job import JobSpec
from service.service import Service

JOB = {"method": "grpo", "model": {"builtin": "tiny-qwen2"}, "reward": {"function": "builtin:arithmetic"},
       "trainer": {"total_steps": 100_000}, "metadata": {"suite": "bench-api-cpu"}}  # fmt: skip
METRICS = {f"group{g}/metric{m}": 0.123456789 * (g + m) for g in range(6) for m in range(10)}


async def call(app, path: str, query: str, token: str) -> tuple[int, bytes]:
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "GET",
             "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": query.encode(),
             "root_path": "", "headers": [(b"host", b"127.0.0.1"), (b"authorization", f"Bearer {token}".encode())],
             "client": ("127.0.0.1", 5000), "server": ("127.0.0.1", 8000)}  # fmt: skip
    out: dict = {"body": b""}

    async def receive() -> dict:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict) -> None:
        if message["type"] == "http.response.start":
            out["status"] = message["status"]
        else:
            out["body"] += message.get("body", b"")

    await app(scope, receive, send)
    return out["status"], out["body"]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=300, help="metrics rows already stored")
    parser.add_argument("--jobs", type=int, default=20)
    parser.add_argument("--requests", type=int, default=4000, help="per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--writes-per-s", type=float, default=0.0)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="tapicpu-") as tmp:
        service = Service(Path(tmp))
        token = ensure_admin_token(service.store, Path(tmp)).read_text().strip()
        spec = JobSpec.model_validate(JOB).model_dump(mode="json")
        ids = [service.store.create_job(spec, service.jobs_root).id for _ in range(args.jobs)]
        for step in range(1, args.steps + 1):
            service.store.add_metrics(ids[-1], step, METRICS)
        app = create_app(service)
        paths = [("/v1/jobs", "limit=20"), (f"/v1/jobs/{ids[-1]}/metrics", "max_points=300")]
        stop, written = threading.Event(), [0]

        def writer() -> None:
            step = args.steps
            while not stop.wait(1 / args.writes_per_s):
                step += 1
                service.store.add_metrics(ids[-1], step, METRICS)
                written[0] += 1

        async def rounds() -> None:
            for path, query in paths:  # warm: the first read of each page, and the learned query strings
                status, body = await call(app, path, query, token)
                assert status == 200, body
            for r in range(args.rounds):
                reads0, written0 = service_reads(app), written[0]
                cpu0, wall0 = time.process_time(), time.perf_counter()
                for i in range(args.requests):
                    status, body = await call(app, *paths[i % 2], token)
                    if status != 200:
                        raise SystemExit(f"{paths[i % 2]}: {status} {body[:200]!r}")
                cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
                print(json.dumps({"bench": "api_cpu", "round": r, "requests": args.requests,
                                  "cpu_ms_per_request": round(1000 * cpu / args.requests, 4),
                                  "wall_ms_per_request": round(1000 * wall / args.requests, 4),
                                  "cache_reads": service_reads(app) - reads0, "rows_written": written[0] - written0,
                                  "steps": args.steps, "jobs": args.jobs, "writes_per_s": args.writes_per_s,
                                  "load_avg_1m": round(os.getloadavg()[0], 2)}), flush=True)  # fmt: skip

        thread = threading.Thread(target=writer, daemon=True)
        if args.writes_per_s > 0:
            thread.start()
        try:
            uvloop.run(rounds())
        finally:
            stop.set()


def service_reads(app) -> int:
    """Reads the read cache made (its misses)."""
    return app.state.read_cache.reads


if __name__ == "__main__":
    main()
