"""One job as a user runs it: `tandem serve` in its own process, the spec submitted over HTTP, the job
followed to its end, then its per-step metrics (each with the step's end time) and events read back.

bench/vs_trl.py runs its Tandem side this way with `--served` (the default on CUDA).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
START_TIMEOUT_S = 180.0
TERMINAL = {"succeeded", "failed", "cancelled"}


def run_served_job(
    spec: dict[str, Any], home: Path, allow: list[Path], timeout_s: float, unsandboxed: bool = False
) -> dict[str, Any]:
    """{"job": the final job, "metrics": rows of {"step", "time", "values"}, "events": [...]}; raises
    when the service does not start, the job does not succeed, or it runs past `timeout_s`.
    `unsandboxed`: the service runs user code (the bench's own reward) without a sandbox, for a
    machine that has none (a lent GPU image without bubblewrap)."""
    home.mkdir(parents=True, exist_ok=True)
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "TANDEM_HOME": str(home), "PYTHONPATH": path}
    command = [sys.executable, "-m", "api.cli", "serve", "--home", str(home)]
    command += [f"--allow-path={p}" for p in allow]
    command += ["--unsandboxed-user-code"] if unsandboxed else []
    with (home / "serve.log").open("w") as log:
        server = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
        try:
            with connect(server, home) as client:
                return follow(client, client.create_job(spec), timeout_s)
        finally:
            server.terminate()
            try:
                server.wait(timeout=60)
            except subprocess.TimeoutExpired:
                server.kill()


def connect(server: subprocess.Popen, home: Path) -> Any:
    """A client of the service once it answers /readyz at the URL it recorded in `home` (the record is
    written before the socket listens); the serve log's tail when it exits or does not within
    START_TIMEOUT_S."""
    from api.client import TandemClient
    from api.service_record import ready_url

    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline and server.poll() is None:
        url = ready_url(home, server.pid)
        if url is not None:
            return TandemClient(url, (home / "admin_token").read_text().strip())
        time.sleep(1.0)
    tail = (home / "serve.log").read_text()[-3000:]
    raise RuntimeError(f"`tandem serve` did not start within {START_TIMEOUT_S:.0f} s:\n{tail}")


def follow(client: Any, job: dict[str, Any], timeout_s: float) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while job["status"] not in TERMINAL:
        if time.monotonic() > deadline:
            raise TimeoutError(f"job {job['id']} still {job['status']} after {timeout_s:.0f} s")
        time.sleep(1.0)
        job = client.get_job(job["id"])
    events = client.events(job["id"])["data"]
    if job["status"] != "succeeded":
        tail = [f"{e.get('kind')}: {e.get('message')}" for e in events[-8:]]
        raise RuntimeError(f"job {job['id']} {job['status']}:\n" + "\n".join(tail))
    return {"job": job, "metrics": client.metrics(job["id"])["data"], "events": events}
