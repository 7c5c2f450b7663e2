"""`tandem serve` killed with SIGKILL mid-job, then started again on the same home.

The job resumes from its last checkpoint c; the steps after c that the killed run had recorded are
run again, and the store keeps one row per step: the resumed run's. While it starts again the job
shows step c. The killed service's Ray processes (the raylet's DashboardAgent and RuntimeEnvAgent
included) do not outlive it. Ray runs inside `serve` here (a local cluster), in a private temp dir.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import sqlite3
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from api.reaper import _stat, descendants
from controller import checkpoints
from tests.api_util import tiny_job, wait_for, wait_for_step
from tests.serve_util import (
    BIN,
    Served,
    cluster_env,
    free_ports,
    kill_leftovers,
    start_logged,
    stop,
    wait_until,
)

TOTAL, EVERY = 16, 6  # the kill lands 1-2 steps past a checkpoint, 4 steps (1.6 s or more) before the next
PACED = "tests.reward_fns:paced_digit_reward"  # 0.4 s a step at least, however fast the engines are


def start_serve(root: Path, env: dict[str, str], token: str, name: str) -> Served:
    (port,) = free_ports(1)
    url, log = f"http://127.0.0.1:{port}", root / f"{name}.log"
    args = [
        str(BIN / "tandem"),
        "serve",
        "--port",
        str(port),
        "--home",
        str(root / "home"),
        "--num-cpus",
        "4",
    ]
    process = start_logged(args, {**env, "TANDEM_ADMIN_TOKEN": token}, log)

    def ready() -> bool:
        assert process.poll() is None, f"tandem serve exited:\n{log.read_text()[-4000:]}"
        try:
            return httpx.get(url + "/readyz", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    wait_until(ready, "tandem serve was not ready", 120, [log])
    return Served(url, token, root / "home", process, log)


@pytest.fixture()
def crash_dir() -> Iterator[tuple[Path, dict[str, str]]]:
    tmp = tempfile.mkdtemp(prefix="tcr-", dir="/tmp")  # short: Ray's socket paths have a length limit
    try:
        yield Path(tmp), cluster_env(tmp)
    finally:
        kill_leftovers(tmp)
        shutil.rmtree(tmp, ignore_errors=True)


def alive(procs: set[tuple[int, int]]) -> set[tuple[int, int]]:
    return {p for p in procs if (info := _stat(p[0])) is not None and info[1] == p[1]}


def recorded_step(db: Path, job_id: str) -> int:
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=5) as conn:
        return conn.execute("SELECT MAX(step) FROM metrics WHERE job_id = ?", (job_id,)).fetchone()[0] or 0


def test_kill_9_mid_job_then_restart_stores_each_step_once(crash_dir):
    root, env = crash_dir
    token = "tdm_" + secrets.token_urlsafe(24)
    first = start_serve(root, env, token, "first")
    spec = tiny_job(reward={"function": PACED}, trainer={"total_steps": TOTAL},
                    checkpoint={"every": EVERY, "keep_last": 5}, metadata={"suite": "crash"})  # fmt: skip
    try:
        with first.client() as client:
            job = client.post("/v1/jobs", json=spec).json()
            wait_for_step(client, job["id"], EVERY, timeout_s=240)
        db = root / "home" / "tandem.db"
        # The kill follows the store, not the API's view of it: as soon as a step past the checkpoint
        # is recorded.
        wait_until(
            lambda: recorded_step(db, job["id"]) > EVERY,
            "no step past the checkpoint was recorded",
            60,
            [first.log],
        )
        ray_processes = descendants(first.process.pid)
        assert any(
            b"DashboardAgent" in Path(f"/proc/{pid}/cmdline").read_bytes() for pid, _ in alive(ray_processes)
        )
        os.kill(first.process.pid, signal.SIGKILL)
        first.process.wait(10)
        killed_at = time.time()
    finally:
        stop(first.process, 10)
    wait_until(lambda: not alive(ray_processes), "Ray processes outlived the killed service", 20, [first.log])
    resume_from = checkpoints.complete(Path(job["outputs"]["workdir"]))[-1][0]
    recorded = recorded_step(db, job["id"])
    assert recorded > resume_from, "the kill came before any step past the checkpoint was recorded"

    second = start_serve(root, env, token, "second")
    try:
        with second.client() as client:
            restarted = client.get(f"/v1/jobs/{job['id']}").json()
            assert restarted["status"] in ("queued", "running")
            assert restarted["step"] == resume_from  # the checkpoint step, not the killed run's last step
            done = wait_for(client, job["id"], ("succeeded", "failed", "cancelled"), timeout_s=300)
            assert done["status"] == "succeeded", second.log_tail()
            rows = client.get(f"/v1/jobs/{job['id']}/metrics").json()["data"]
    finally:
        stop(second.process, 60)
    assert [r["step"] for r in rows] == list(range(1, TOTAL + 1))  # each step once, in order
    assert all(r["time"] > killed_at for r in rows if r["step"] > resume_from)  # the resumed run's values
    assert all(r["time"] < killed_at for r in rows if r["step"] <= resume_from)
    with sqlite3.connect(db) as conn:
        dupes = conn.execute(
            "SELECT step FROM metrics WHERE job_id = ? GROUP BY step HAVING COUNT(*) > 1", (job["id"],)
        ).fetchall()
    assert dupes == []
