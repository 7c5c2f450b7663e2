"""Bounded HTTP load on the API while a job trains: p50/p99 of the job list and a job's metrics.

    python bench/load.py                       # starts its own `tandem serve` (temp home), then stops it
    python bench/load.py --url http://127.0.0.1:8000 --token tdm_...   # an already running service

It submits a long tiny-qwen2 job, waits until it trains, then measures, in the same run:
1. a baseline: one client for --baseline-s seconds;
2. the load: --clients clients for --seconds seconds, each sending its next request as soon as the
   last one answered (keep-alive connections), alternating GET /v1/jobs and
   GET /v1/jobs/{id}/metrics (with --metrics-query, the dashboard's downsampled view by default),
   with a minimal HTTP/1.1 client on asyncio streams (--client raw) or httpx (--client httpx).
Then it cancels the job and, when it started the service, stops it. Only 127.0.0.1 is accepted.
Prints JSON lines: one per phase and route with p50/p99 in ms, the ratio to the baseline, and where
the CPU went during the phase (the service process's and this client's CPU per request, the cores
the machine kept busy, and those in niced processes: Ray runs its workers at nice 15).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import httpx
import psutil
import uvloop

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.harness import percentile  # noqa: E402

JOB = {
    "method": "grpo",
    "model": {"builtin": "tiny-qwen2"},
    "reward": {"function": "builtin:arithmetic"},
    "trainer": {"total_steps": 100_000, "prompts_per_step": 4, "val_every": 0},
    "rollout": {"n": 4, "max_new_tokens": 4},
    "checkpoint": {"every": 50, "keep_last": 1, "export_hf": False},
    "metadata": {"suite": "bench-load"},
}


def route_of(path: str) -> str:
    return path.split("?")[0].rsplit("/", 1)[-1]


async def httpx_client(
    url: str, token: str, paths: list[str], until: float, out: dict[str, list[float]]
) -> None:
    async with httpx.AsyncClient(
        base_url=url, headers={"Authorization": f"Bearer {token}"}, timeout=60
    ) as http:
        i = 0
        while time.monotonic() < until:
            path = paths[i % len(paths)]
            start = time.perf_counter()
            response = await http.get(path)
            elapsed = time.perf_counter() - start
            response.raise_for_status()
            out.setdefault(route_of(path), []).append(elapsed)
            i += 1


async def raw_client(
    url: str, token: str, paths: list[str], until: float, out: dict[str, list[float]]
) -> None:
    """The same requests on one keep-alive connection, written and read with asyncio streams: HTTP/1.1
    GETs whose answers carry a Content-Length. httpx spent 2.6-3.1 ms of CPU per request here, twice
    what the service spent answering it, so on a 2-core machine it measured itself."""
    where = urlparse(url)
    reader, writer = await asyncio.open_connection(where.hostname, where.port)
    requests = [f"GET {p} HTTP/1.1\r\nHost: {where.netloc}\r\nAuthorization: Bearer {token}\r\n\r\n".encode()
                for p in paths]  # fmt: skip
    try:
        i = 0
        while time.monotonic() < until:
            start = time.perf_counter()
            writer.write(requests[i % len(paths)])
            head = await reader.readuntil(b"\r\n\r\n")
            length = re.search(rb"(?i)\r\ncontent-length: *(\d+)", head)
            if not head.startswith(b"HTTP/1.1 200 ") or length is None:
                raise SystemExit(f"GET {paths[i % len(paths)]}: {head[:200]!r}")
            await reader.readexactly(int(length[1]))
            out.setdefault(route_of(paths[i % len(paths)]), []).append(time.perf_counter() - start)
            i += 1
    finally:
        writer.close()


CLIENTS = {"raw": raw_client, "httpx": httpx_client}


def measure(
    url: str, token: str, paths: list[str], clients: int, seconds: float, kind: str = "raw"
) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {}

    async def main() -> None:
        until = time.monotonic() + seconds
        # each client starts on a different route, so both are loaded all the time
        await asyncio.gather(*(CLIENTS[kind](url, token, paths[i % 2 :] + paths[: i % 2], until, out)
                               for i in range(clients)))  # fmt: skip

    uvloop.run(main())
    return out


def summary(phase: str, clients: int, seconds: float, times: dict[str, list[float]]) -> list[dict]:
    return [
        {"bench": "api_load", "phase": phase, "route": route, "clients": clients, "requests": len(values),
         "rps": round(len(values) / seconds, 1), "p50_ms": round(1000 * percentile(values, 50), 2),
         "p99_ms": round(1000 * percentile(values, 99), 2)}
        for route, values in sorted(times.items())
    ]  # fmt: skip


def start_service(home: Path, cpus: int) -> tuple[subprocess.Popen, str, str]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    token = "tdm_" + secrets.token_urlsafe(24)
    env = {**os.environ, "TANDEM_ADMIN_TOKEN": token, "RAY_TMPDIR": str(home), "PYTHONPATH": str(REPO)}
    env.pop("RAY_ADDRESS", None)
    args = [sys.executable, "-m", "api.cli", "serve", "--port", str(port), "--home", str(home / "home"),
            "--num-cpus", str(cpus)]  # fmt: skip
    log = (home / "serve.log").open("w")
    process = subprocess.Popen(
        args, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"tandem serve exited; see {home / 'serve.log'}")
        try:
            if httpx.get(url + "/readyz", timeout=2).status_code == 200:
                return process, url, token
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    process.send_signal(signal.SIGTERM)
    raise SystemExit("tandem serve was not ready within 180 s")


def wait_training(http: httpx.Client, job_id: str, steps: int, timeout_s: float = 600) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        job = http.get(f"/v1/jobs/{job_id}").json()
        if job["status"] in ("failed", "cancelled", "succeeded"):
            raise SystemExit(f"the job ended before the load: {job['status']} {job['error']}")
        if job["status"] == "running" and job["step"] >= steps:
            return job
        time.sleep(1)
    raise SystemExit(f"the job did not reach step {steps} in {timeout_s:.0f} s")


def cpu_use(server_pid: int | None, run_phase: Callable[[], dict[str, list[float]]]) -> tuple[dict, dict]:
    """Run a phase; return its times and where the CPU went: the service process, this client, the
    machine (cores busy, and cores busy in niced processes: the service's Ray workers by default)."""
    server = psutil.Process(server_pid) if server_pid else None

    def snapshot() -> tuple[float, float, Any, float]:
        served = sum(server.cpu_times()[:2]) if server else 0.0
        return served, time.process_time(), psutil.cpu_times(), time.monotonic()

    (s0, c0, m0, t0), times, (s1, c1, m1, t1) = snapshot(), run_phase(), snapshot()
    requests, wall = sum(len(v) for v in times.values()), t1 - t0
    busy = (sum(m1) - m1.idle - m1.iowait) - (sum(m0) - m0.idle - m0.iowait)
    use = {
        "server_cpu_ms_per_request": round(1000 * (s1 - s0) / requests, 3) if server else None,
        "client_cpu_ms_per_request": round(1000 * (c1 - c0) / requests, 3),
        "machine_busy_cores": round(busy / wall, 2),
        "niced_busy_cores": round((m1.nice - m0.nice) / wall, 2),
    }
    return times, use


def run(args: argparse.Namespace, url: str, token: str, server_pid: int | None = None) -> None:
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {token}"}, timeout=60) as http:
        job = http.post("/v1/jobs", json=JOB).json()
        try:
            wait_training(http, job["id"], args.warm_steps)
            paths = ["/v1/jobs?limit=20", f"/v1/jobs/{job['id']}/metrics?{args.metrics_query}"]
            times, base_use = cpu_use(
                server_pid, lambda: measure(url, token, paths, 1, args.baseline_s, args.client)
            )
            base = [{**row, **base_use} for row in summary("baseline", 1, args.baseline_s, times)]
            start_step = http.get(f"/v1/jobs/{job['id']}").json()["step"]
            times, load_use = cpu_use(
                server_pid, lambda: measure(url, token, paths, args.clients, args.seconds, args.client)
            )
            loaded = [{**row, **load_use} for row in summary("load", args.clients, args.seconds, times)]
            steps = http.get(f"/v1/jobs/{job['id']}").json()["step"]
            for row in loaded:
                row["job_steps_during_load"] = steps - start_step
        finally:
            http.post(f"/v1/jobs/{job['id']}/cancel")
    p99 = {row["route"]: row["p99_ms"] for row in base}
    p50 = {row["route"]: row["p50_ms"] for row in base}
    for row in base + loaded:
        row["p50_ratio"] = round(row["p50_ms"] / p50[row["route"]], 2)
        row["p99_ratio"] = round(row["p99_ms"] / p99[row["route"]], 2)
        row["job_steps"], row["load_avg_1m"] = steps, round(os.getloadavg()[0], 2)
        row["metrics_query"] = args.metrics_query
        row["client"] = args.client
        print(json.dumps(row), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--url", help="a running service (127.0.0.1 only); default: start one")
    parser.add_argument("--token", default=os.environ.get("TANDEM_TOKEN"), help="its admin token")
    parser.add_argument("--clients", type=int, default=50)
    parser.add_argument("--seconds", type=float, default=30.0, help="length of the loaded phase")
    parser.add_argument("--baseline-s", type=float, default=10.0, help="length of the one-client phase")
    parser.add_argument("--warm-steps", type=int, default=3, help="steps the job runs before the load")
    parser.add_argument("--metrics-query", default="max_points=300", help="query of the metrics route")
    parser.add_argument("--client", choices=sorted(CLIENTS), default="raw", help="the load's HTTP client")
    parser.add_argument("--cpus", type=int, default=4, help="CPUs of the Ray cluster a started service makes")
    args = parser.parse_args()
    if args.clients < 1 or args.seconds <= 0 or args.seconds > 600 or args.clients > 500:
        raise SystemExit("--clients must be 1..500 and --seconds 0..600: the load is bounded")
    if args.url:
        if urlparse(args.url).hostname not in ("127.0.0.1", "localhost"):
            raise SystemExit("--url must be on 127.0.0.1: this script loads only a local service")
        if not args.token:
            raise SystemExit("--token (or TANDEM_TOKEN) is needed with --url")
        run(args, args.url, args.token)
        return
    with tempfile.TemporaryDirectory(prefix="tload-", dir="/tmp") as tmp:
        process, url, token = start_service(Path(tmp), args.cpus)
        try:
            run(args, url, token, process.pid)
        finally:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(120)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)


if __name__ == "__main__":
    main()
