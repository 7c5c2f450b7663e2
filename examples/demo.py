"""`make run`: the service, and the demo pipeline submitted through its API.

1. Starts `tandem serve` on TANDEM_HOME (default ~/.tandem, the CLI's home too): a local Ray and the
   API on http://127.0.0.1:8000, or a free port when 8000 is taken. The service records its URL in
   $TANDEM_HOME/service.json, so `tandem list` in another terminal finds it. A service already
   running on that home is used as it is (and left running).
2. Submits examples/sft_arithmetic.yaml: SFT warm-starts the built-in qwen2-1m model (about 0.8M parameters) on 2-digit
   addition to a modest accuracy. A progress bar follows it (step/total, loss, val accuracy, ETA).
3. Submits examples/grpo_arithmetic.yaml with model.path set to the SFT job's HF export: GRPO raises
   the validation accuracy. Followed the same way.
4. Prints a summary and leaves the service and its dashboard running until Ctrl-C, which stops it
   gracefully (running jobs checkpoint and resume at the next start). SIGTERM and SIGHUP (`kill`, a
   CI timeout, a closed terminal) stop it the same way: the service never outlives the demo.

Everything goes through the REST API with the admin token, as a user's own scripts would.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import yaml

from api.cli_watch import follow
from api.client import TandemClient, client_home
from api.service_record import read_record, ready_url

EXAMPLES = Path(__file__).resolve().parent
ROOT = EXAMPLES.parent


def service_log(home: Path) -> Path:
    """Where the demo's service writes its output: the terminal shows the demo's progress only."""
    return home / "logs" / "service.log"


def start_service(home: Path, extra: list[str] | None = None) -> subprocess.Popen:
    # The port: TANDEM_PORT or 8000, or a free one; the service records it in the home.
    command = [sys.executable, "-m", "api.cli", "serve", "--home", str(home), *(extra or [])]
    log = service_log(home)
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("ab") as out:  # the child keeps its own descriptor
        return subprocess.Popen(
            command,
            cwd=ROOT,
            env={**os.environ, "TANDEM_HOME": str(home)},
            stdout=out,
            stderr=subprocess.STDOUT,
        )


def log_tail(path: Path, lines: int = 20) -> str:
    text = path.read_text(errors="replace") if path.exists() else ""
    return "\n".join(text.splitlines()[-lines:])


def wait_ready(home: Path, server: subprocess.Popen, timeout_s: float = 300) -> str:
    """The URL the new service recorded in its home, once it answers /readyz."""
    deadline = time.time() + timeout_s
    log = service_log(home)
    while time.time() < deadline:
        if server.poll() is not None:
            raise SystemExit(
                f"tandem serve exited with code {server.returncode}. The end of {log}:\n{log_tail(log)}"
            )
        url = ready_url(home, server.pid)
        if url:
            print(f"Service started on {url}; its output goes to {log}", flush=True)
            return url
        time.sleep(0.5)
    raise SystemExit(
        f"the service did not become ready within {timeout_s:.0f}s. The end of {log}:\n{log_tail(log)}"
    )


# The demo's job that is running now, if any: a stop says it paused, even when the service is
# already going (Ctrl-C reaches the service too) and cannot be asked.
FOLLOWING: dict[str, dict] = {}


def run_job(client: TandemClient, spec: dict, title: str) -> dict:
    job = client.create_job(spec)
    FOLLOWING.clear()
    FOLLOWING[job["id"]] = job
    print(
        f"\n== {title}: job {job['id']} ({spec['method']}, {spec['trainer']['total_steps']} steps)",
        flush=True,
    )
    follow(client, job["id"])
    job = client.get_job(job["id"])
    FOLLOWING.pop(job["id"], None)
    if job["status"] != "succeeded":
        raise SystemExit(f"{title} ended {job['status']}: {job.get('error')}")
    return job


def val_curve(client: TandemClient, job_id: str) -> list[tuple[int, float]]:
    rows = client.metrics(job_id, keys=["val/accuracy"])["data"]
    return [
        (r["step"], r["values"]["val/accuracy"]) for r in rows if r["values"].get("val/accuracy") is not None
    ]


def _stop(signum: int, _frame: object) -> None:
    """SIGTERM/SIGHUP end the demo through its `finally`, which stops the service it started."""
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m examples.demo", description="make run: SFT, then GRPO")
    parser.add_argument("--seed", type=int, default=0, help="trainer.seed of both jobs (data order)")
    parser.add_argument("--exit", action="store_true", help="stop the service after the summary")
    args = parser.parse_args(argv)
    seed = args.seed
    for signum in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, _stop)
    home = client_home().resolve()
    os.environ["TANDEM_HOME"] = str(home)  # the service's home, and where the client finds URL and token
    running = read_record(home)
    server = None if running else start_service(home)
    url = None
    try:
        url = running["url"] if running else wait_ready(home, server)
        if running:
            print(f"Using the service already running on {home}: {url} (pid {running['pid']})", flush=True)
        client = TandemClient(url=url)
        started = time.time()
        sft_spec = yaml.safe_load((EXAMPLES / "sft_arithmetic.yaml").read_text())
        sft_spec["trainer"]["seed"] = seed
        sft = run_job(client, sft_spec, "SFT warm start")
        grpo_spec = yaml.safe_load((EXAMPLES / "grpo_arithmetic.yaml").read_text())
        grpo_spec["model"] = {"path": sft["outputs"]["export"]}
        grpo_spec["trainer"]["seed"] = seed
        grpo = run_job(client, grpo_spec, "GRPO from the SFT export")
        sft_curve, grpo_curve = val_curve(client, sft["id"]), val_curve(client, grpo["id"])
        print(f"\n== Summary (seed {seed})")
        print(f"SFT  {sft['id']}: val accuracy {sft_curve[0][1]:.3f} -> {sft_curve[-1][1]:.3f}")
        print(f"GRPO {grpo['id']}: val accuracy {grpo_curve[0][1]:.3f} -> {grpo_curve[-1][1]:.3f}")
        print(f"total {(time.time() - started) / 60:.1f} min; GRPO model: {grpo['outputs']['export']}")
        print(f"\nDashboard: {url}/  (sign in with the token in {home / 'admin_token'})")
        print(f"In another terminal: .venv/bin/tandem list   (it finds {url} through {home})")
        if server is None or args.exit:
            return 0
        print("The service keeps running; Ctrl-C stops it (running jobs pause and resume at its next start).",
              flush=True)  # fmt: skip
        server.wait()
    except KeyboardInterrupt:
        pass
    finally:
        if server is not None:
            stop_service(server, home, url)
    return 0


def active_jobs(url: str | None) -> list[dict]:
    """The jobs a stop will pause: the service's list when it still answers, else the demo's own."""
    if url is not None:
        try:
            with TandemClient(url=url) as client:
                return client.list_jobs(status=["running", "pausing", "queued"], limit=100)["data"]
        except Exception:  # the service is already going (Ctrl-C reached it too): say what we know
            pass
    return [{**job, "step": None} for job in FOLLOWING.values()]  # its step is no longer known


def stop_service(server: subprocess.Popen, home: Path, url: str | None) -> None:
    """Stop the service the demo started (it pauses running jobs at a checkpoint) and say so."""
    jobs = active_jobs(url if server.poll() is None else None)
    print("\n== Stopping the service: running jobs pause at their next step, with a checkpoint", flush=True)
    if server.poll() is None:
        server.send_signal(signal.SIGTERM)
    try:
        server.wait(timeout=300)
    except subprocess.TimeoutExpired:
        server.kill()
    for job in jobs:
        where = "" if job["step"] is None else f"; it was at step {job['step']}/{job['total_steps']}"
        print(f"paused {job['id']} ({job['method']}{where})", flush=True)
    restart = f"`make run`, or `.venv/bin/tandem serve` on {home}"
    if jobs:
        print(f"Stopped. The paused jobs resume from their checkpoints when the service starts again: {restart} "
              "(then `tandem list`).", flush=True)  # fmt: skip
    else:
        print(f"Stopped; no job was running. {restart} starts the service again.", flush=True)


if __name__ == "__main__":
    sys.exit(main())
