"""`make run`: the service, and the demo pipeline submitted through its API.

1. Starts `tandem serve` (a local Ray and the API on http://127.0.0.1:8000, or the next free port).
2. Submits examples/sft_arithmetic.yaml: SFT warm-starts the built-in ~0.8M-parameter model on 2-digit
   addition to a modest accuracy. A progress bar follows it (step/total, loss, val accuracy, ETA).
3. Submits examples/grpo_arithmetic.yaml with model.path set to the SFT job's HF export: GRPO raises
   the validation accuracy. Followed the same way.
4. Prints a summary and leaves the service and its dashboard running until Ctrl-C, which stops it
   gracefully (running jobs checkpoint and resume at the next start).

Everything goes through the REST API with the admin token, as a user's own scripts would.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import yaml

from api.cli_watch import follow
from api.client import TandemClient

EXAMPLES = Path(__file__).resolve().parent
ROOT = EXAMPLES.parent


def free_port(preferred: int) -> int:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", preferred))
            return preferred
        except OSError:
            sock.bind(("127.0.0.1", 0))
            return sock.getsockname()[1]


def start_service(home: Path, port: int) -> subprocess.Popen:
    command = [sys.executable, "-m", "api.cli", "serve", "--port", str(port), "--home", str(home)]
    return subprocess.Popen(command, cwd=ROOT, env={**os.environ, "TANDEM_HOME": str(home)})


def wait_ready(url: str, server: subprocess.Popen, timeout_s: float = 180) -> None:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if server.poll() is not None:
            raise SystemExit(f"tandem serve exited with code {server.returncode}; see its output above")
        try:
            if httpx.get(url + "/readyz", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"the service did not become ready within {timeout_s:.0f}s")


def run_job(client: TandemClient, spec: dict, title: str) -> dict:
    job = client.create_job(spec)
    print(
        f"\n== {title}: job {job['id']} ({spec['method']}, {spec['trainer']['total_steps']} steps)",
        flush=True,
    )
    follow(client, job["id"])
    job = client.get_job(job["id"])
    if job["status"] != "succeeded":
        raise SystemExit(f"{title} ended {job['status']}: {job.get('error')}")
    return job


def val_curve(client: TandemClient, job_id: str) -> list[tuple[int, float]]:
    rows = client.metrics(job_id, keys=["val/accuracy"])["data"]
    return [
        (r["step"], r["values"]["val/accuracy"]) for r in rows if r["values"].get("val/accuracy") is not None
    ]


def main() -> int:
    home = Path(os.environ.get("TANDEM_HOME", ROOT / ".tandem")).resolve()
    port = free_port(int(os.environ.get("TANDEM_PORT", "8000")))
    url = f"http://127.0.0.1:{port}"
    os.environ["TANDEM_HOME"] = str(home)  # the client reads the admin token from there
    server = start_service(home, port)
    try:
        wait_ready(url, server)
        client = TandemClient(url=url)
        started = time.time()
        sft_spec = yaml.safe_load((EXAMPLES / "sft_arithmetic.yaml").read_text())
        sft = run_job(client, sft_spec, "SFT warm start")
        grpo_spec = yaml.safe_load((EXAMPLES / "grpo_arithmetic.yaml").read_text())
        grpo_spec["model"] = {"path": sft["outputs"]["export"]}
        grpo = run_job(client, grpo_spec, "GRPO from the SFT export")
        sft_curve, grpo_curve = val_curve(client, sft["id"]), val_curve(client, grpo["id"])
        print("\n== Summary")
        print(f"SFT  {sft['id']}: val accuracy {sft_curve[0][1]:.2f} -> {sft_curve[-1][1]:.2f}")
        print(f"GRPO {grpo['id']}: val accuracy {grpo_curve[0][1]:.2f} -> {grpo_curve[-1][1]:.2f}")
        print(f"total {(time.time() - started) / 60:.1f} min; GRPO model: {grpo['outputs']['export']}")
        print(f"\nDashboard: {url}/  (sign in with the token in {home / 'admin_token'})")
        print("The service keeps running; Ctrl-C stops it.", flush=True)
        server.wait()
    except KeyboardInterrupt:
        pass
    finally:
        if server.poll() is None:
            server.send_signal(signal.SIGTERM)
            try:
                server.wait(timeout=300)
            except subprocess.TimeoutExpired:
                server.kill()
    return 0


if __name__ == "__main__":
    sys.exit(main())
