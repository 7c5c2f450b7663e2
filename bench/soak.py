"""Does the service keep its promises under mixed load while its processes are killed?

A real `tandem serve` (a fresh home in a temp dir, its own local Ray) serves three owners for
`--minutes`. Each owner runs two lanes, one thing at a time each: RL jobs (sync, async with split
placement, LoRA) in one; Tinker loops (the official SDK) and an external job fed by agent
trajectories (the `openai` SDK) in the other. Every `--chaos-every` seconds a chaos thread kills with
SIGKILL one of: the service (restarted on the same home and port), a job's training worker, a rollout
worker, or the Tinker session host (bench/soak_chaos.py finds them). A prober times /healthz and
/v1/jobs every second.

At the end (after `--grace` seconds for the last jobs): every job succeeded or failed with a stated
reason; each job's metrics hold every step once, 1..last; every Tinker call returned or raised a
clear error within its bound; the uploads and every listed checkpoint are on disk; the API's p99
between kills is within `--p99-bound`. One JSON line per figure and per check; exit 1 if a check
fails. Traffic goes to 127.0.0.1 only.

    python bench/soak.py --minutes 3 --chaos-every 45
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import secrets
import shutil
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.harness import percentile  # noqa: E402
from bench.soak_chaos import Prober, descendants, kill, worker_targets  # noqa: E402
from bench.soak_load import Api, Lanes  # noqa: E402
from tests.serve_util import BIN, cluster_env, free_ports, kill_leftovers, start_logged  # noqa: E402

OWNERS = ("ada", "bo", "cy")
KINDS = ("service", "training", "rollout", "session_host")
RESTART_SETTLE_S = 15.0  # after a restarted service answers, before its latencies count again


def emit(**row) -> None:
    print(json.dumps(row), flush=True)


class Served:
    """`tandem serve` on one home and port, killed and started again by the chaos thread."""

    def __init__(self, root: Path, env: dict[str, str], num_cpus: int) -> None:
        self.root, self.home, self.num_cpus = root, root / "home", num_cpus
        self.token = "tdm_" + secrets.token_urlsafe(24)
        self.env = {**env, "TANDEM_ADMIN_TOKEN": self.token}
        (self.port,) = free_ports(1)
        self.url = f"http://127.0.0.1:{self.port}"
        self.starts = 0
        self.process = None

    def start(self, timeout_s: float = 240) -> None:
        self.starts += 1
        args = [
            str(BIN / "tandem"),
            "serve",
            "--port",
            str(self.port),
            "--home",
            str(self.home),
            "--num-cpus",
            str(self.num_cpus),
        ]
        log = self.root / f"serve-{self.starts}.log"
        self.process = start_logged(args, self.env, log)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"tandem serve exited {self.process.returncode}: {log.read_text()[-3000:]}"
                )
            try:
                if httpx.get(self.url + "/readyz", timeout=3).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"tandem serve was not ready within {timeout_s:.0f} s: {log.read_text()[-3000:]}")

    def kill_and_restart(self) -> int:
        """SIGKILL the service, wait for its Ray processes to go (its reaper ends them), start again."""
        pid = self.process.pid
        under = descendants(pid)
        kill(pid)
        self.process.wait(30)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and any(Path(f"/proc/{p}").exists() for p in under):
            time.sleep(0.5)
        left = [p for p in under if Path(f"/proc/{p}").exists()]
        if left:
            emit(note="processes outlived the killed service", pids=left)
        self.start()
        return pid

    def stop(self, timeout_s: float = 90) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout_s)
            except Exception:  # noqa: BLE001 - a service that will not stop is killed with its group
                os.killpg(self.process.pid, signal.SIGKILL)


class Chaos:
    """Every `every_s`, SIGKILL one process of a kind drawn at random among those that have one."""

    def __init__(self, served: Served, every_s: float, seed: int, kinds: tuple[str, ...] = KINDS) -> None:
        self.served, self.every_s, self.rng, self.allowed = served, every_s, random.Random(seed), kinds
        self.kills: list[dict] = []
        self.outages: list[tuple[float, float]] = []  # a service kill until it answers, plus settling
        self.stop = threading.Event()
        self.started = time.time()

    def run(self) -> None:
        while not self.stop.wait(self.every_s):
            try:
                self.strike()
            except Exception as err:  # noqa: BLE001 - a failed strike is reported, the soak goes on
                emit(chaos_error=f"{type(err).__name__}: {err}"[:500])

    def strike(self) -> None:
        targets = worker_targets(self.served.process.pid, self.served.env)
        kinds = [k for k in self.allowed if k == "service" or targets.get(k)]
        if not kinds:
            emit(
                chaos="nothing of the kinds asked for runs now",
                candidates={k: len(v) for k, v in targets.items()},
            )
            return
        kind = self.rng.choice(kinds)
        at = time.time()
        if kind == "service":
            pid = self.served.kill_and_restart()
            self.outages.append((at, time.time() + RESTART_SETTLE_S))
        else:
            pid = self.rng.choice(targets[kind])
            if not kill(pid):
                return
        candidates = {k: len(v) for k, v in targets.items()}
        row = {"kill": kind, "pid": pid, "at_s": round(at - self.started, 1), "candidates": candidates}
        emit(**row)
        self.kills.append({**row, "at": at})


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=30.0, help="how long work is submitted")
    parser.add_argument("--chaos-every", type=float, default=120.0, help="seconds between kills")
    parser.add_argument("--grace", type=float, default=300.0, help="seconds the last work gets to end")
    parser.add_argument("--p99-bound", type=float, default=2.0, help="seconds: API p99 between kills")
    parser.add_argument("--num-cpus", type=int, default=10, help="the local Ray cluster's CPUs")
    parser.add_argument(
        "--kinds", default=",".join(KINDS), help=f"what the chaos thread kills (of {','.join(KINDS)})"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--keep", action="store_true", help="keep the temp dir (logs, home)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if unknown := set(args.kinds.split(",")) - set(KINDS):
        sys.exit(f"--kinds: unknown {sorted(unknown)}; choose among {','.join(KINDS)}")
    logging.getLogger("tinker").setLevel(logging.ERROR)  # its retries while a service restarts
    tmp = tempfile.mkdtemp(prefix="tsoak-", dir="/tmp")  # short: Ray's socket paths have a length limit
    served = Served(Path(tmp), cluster_env(tmp), args.num_cpus)
    emit(soak="start", dir=tmp, minutes=args.minutes, chaos_every_s=args.chaos_every)
    try:
        served.start()
        return soak(served, args)
    finally:
        served.stop()
        kill_leftovers(tmp)
        if not args.keep:
            shutil.rmtree(tmp, ignore_errors=True)


def soak(served: Served, args: argparse.Namespace) -> int:
    started = time.time()
    admin = Api(served.url, served.token)
    keys = {o: admin.call("POST", "/v1/keys", json={"owner": o}).json()["key"] for o in OWNERS}
    stop_at = started + args.minutes * 60
    lanes = Lanes(served.url, served.home, keys, stop_at, hard_end=stop_at + args.grace)
    lanes.upload_files()
    prober, chaos = (
        Prober(served.url, served.token),
        Chaos(served, args.chaos_every, args.seed, tuple(args.kinds.split(","))),
    )
    threads = [threading.Thread(target=t.run, daemon=True) for t in (prober, chaos)]
    threads += lanes.threads()
    for thread in threads:
        thread.start()
    while time.time() < lanes.stop_at:
        time.sleep(1)
    chaos.stop.set()
    threads[1].join(timeout=600)  # a restart under way ends first
    lanes.join(lanes.hard_end)
    prober.stop.set()
    threads[0].join(timeout=30)
    return report(served, admin, lanes, prober, chaos, args, time.time() - started)


def report(served, admin, lanes, prober, chaos, args, duration_s: float) -> int:
    checks = lanes.checks(admin)
    latencies, failures = prober.between(chaos.outages)
    p50, p99 = percentile(latencies, 50), percentile(latencies, 99)
    kills = {k: sum(1 for row in chaos.kills if row["kill"] == k) for k in KINDS}
    emit(figure="jobs", **lanes.job_counts(admin))
    emit(figure="kills", **kills)
    emit(figure="api_latency_between_kills", probes=len(latencies), p50_ms=round(p50 * 1000, 1),
         p99_ms=round(p99 * 1000, 1), failures=len(failures))  # fmt: skip
    host_kills = [row["at"] for row in chaos.kills if row["kill"] == "session_host"]
    tinker = lanes.tinker_counts(min(host_kills, default=None))
    emit(figure="tinker", **tinker)
    emit(figure="agent_trajectories", **lanes.agent_counts())
    tinker_errors = {t["call"]: t["error"] for t in lanes.tinker if "error" in t}
    if tinker_errors:
        emit(note="Tinker errors (the last of each call)", **tinker_errors)
    if lanes.agent_errors:
        emit(note="agent errors (first of each kind)", **lanes.agent_errors)
    emit(figure="duration_s", value=round(duration_s, 1))
    checks.append(
        ("api_p99_within_bound", p99 <= args.p99_bound, f"p99 {p99:.3f} s, bound {args.p99_bound} s")
    )
    checks.append(("api_answered_between_kills", not failures, failures[:5]))
    checks.append(("processes_were_killed", bool(chaos.kills), kills))
    after = tinker["loops_after_a_host_kill"], tinker["loops_after_a_host_kill_completed"]
    checks.append(("tinker_loops_complete_after_a_host_kill", after[0] == 0 or after[1] > 0,
                   f"{after[1]} of {after[0]} loops started after the first kill completed"))  # fmt: skip
    for name, ok, detail in checks:
        emit(check=name, ok=ok, detail=detail)
    failed = [name for name, ok, _ in checks if not ok]
    emit(soak="failed" if failed else "passed", failed=failed)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
