"""`tandem serve` killed with SIGKILL mid-job, then started again on the same home.

Two jobs run when it dies, a sync one and an async one (trainer.mode async). Each job resumes from
its last checkpoint c; the steps after c that the killed run had recorded are run again, and the
store keeps one row per step: the resumed run's. While it starts again the job shows step c. Both
jobs are longer than the test needs (neither may end before the other has passed a checkpoint,
however slowly each starts): once each has trained past the steps it re-ran, they are cancelled. The killed service's Ray processes (the raylet's DashboardAgent and RuntimeEnvAgent
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

import pytest

from api.reaper import descendants, proc_stat
from controller import checkpoints
from tests.api_util import tiny_job, wait_for, wait_for_step
from tests.serve_util import cluster_env, kill_leftovers, start_serve, stop, wait_until

TOTAL, EVERY = 200, 3  # the sync job: never run to its end here
ASYNC_TOTAL, ASYNC_EVERY, K = 200, 2, 1
AFTER = 1  # steps each job trains after the last one it re-ran, before it is cancelled
PACED = "tests.reward_fns:paced_digit_reward"  # 0.4 s a step at least, however fast the engines are
# The sync job's steps take 1.6 s or more: a checkpoint every 3 steps leaves two steps' time in which
# a step past it has been recorded, for the async job (placed on two workers) to be past its own.
SLOW_PACED = "tests.reward_fns:slow_paced_digit_reward"


@pytest.fixture()
def crash_dir() -> Iterator[tuple[Path, dict[str, str]]]:
    tmp = tempfile.mkdtemp(prefix="tcr-", dir="/tmp")  # short: Ray's socket paths have a length limit
    try:
        yield Path(tmp), cluster_env(tmp)
    finally:
        kill_leftovers(tmp)
        shutil.rmtree(tmp, ignore_errors=True)


def alive(procs: set[tuple[int, int]]) -> set[tuple[int, int]]:
    return {p for p in procs if (info := proc_stat(p[0])) is not None and info[2] == p[1]}


def recorded_step(db: Path, job_id: str) -> int:
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=5) as conn:
        return conn.execute("SELECT MAX(step) FROM metrics WHERE job_id = ?", (job_id,)).fetchone()[0] or 0


def test_kill_9_mid_job_then_restart_stores_each_step_once(crash_dir):
    """A sync job and an async one (split placement, k = 1) in one service, killed together. Each
    resumes from its own last checkpoint; the async job regenerates what was buffered or in flight
    (controller/async_loop.py), so no draw of its loader is trained twice either."""
    root, env = crash_dir
    token = "tdm_" + secrets.token_urlsafe(24)
    first = start_serve(root, env, token, "first", num_cpus=4)
    # One CPU a worker: both jobs (three workers) fit the service's 4 CPUs and run side by side.
    specs = {
        "sync": tiny_job(reward={"function": SLOW_PACED}, trainer={"total_steps": TOTAL},
                         checkpoint={"every": EVERY, "keep_last": 5}, resources={"cpus_per_worker": 1},
                         metadata={"suite": "crash"}),
        "async": tiny_job(reward={"function": PACED},
                          trainer={"total_steps": ASYNC_TOTAL, "mode": "async", "max_staleness": K},
                          checkpoint={"every": ASYNC_EVERY, "keep_last": 5},
                          resources={"placement": "split", "workers": 1, "cpus_per_worker": 1,
                                     "rollout": {"workers": 1, "cpus_per_worker": 1}},
                          metadata={"suite": "crash"}),
    }  # fmt: skip
    every = {"sync": EVERY, "async": ASYNC_EVERY}
    db = root / "home" / "tandem.db"
    try:
        with first.client() as client:
            jobs = {mode: client.post("/v1/jobs", json=spec).json() for mode, spec in specs.items()}
            assert all("id" in job for job in jobs.values()), jobs
            for mode, job in jobs.items():
                wait_for_step(client, job["id"], every[mode], timeout_s=300)

        # The kill follows the store, not the API's view of it: as soon as each job has recorded a
        # step past its newest complete checkpoint (read at that moment: a job that ran on to its next
        # checkpoint while the other caught up must pass it too).
        def past_a_checkpoint(mode: str, job: dict) -> bool:
            done = checkpoints.complete(Path(job["outputs"]["workdir"]))
            return bool(done) and done[-1][0] >= every[mode] and recorded_step(db, job["id"]) > done[-1][0]

        wait_until(
            lambda: all(past_a_checkpoint(mode, job) for mode, job in jobs.items()),
            "no step past a checkpoint was recorded",
            90,
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
    resume_from = {
        mode: checkpoints.complete(Path(job["outputs"]["workdir"]))[-1][0] for mode, job in jobs.items()
    }
    for mode, job in jobs.items():
        assert recorded_step(db, job["id"]) > resume_from[mode], (
            f"{mode}: killed before a step past its checkpoint"
        )

    killed_step = {mode: recorded_step(db, job["id"]) for mode, job in jobs.items()}
    second = start_serve(root, env, token, "second", num_cpus=4)
    rows = {}
    try:
        with second.client() as client:
            for mode, job in jobs.items():
                restarted = client.get(f"/v1/jobs/{job['id']}").json()
                assert restarted["status"] in ("queued", "running")
                assert (
                    restarted["step"] == resume_from[mode]
                )  # the checkpoint step, not the killed run's last
            for mode, job in jobs.items():
                wait_for_step(client, job["id"], killed_step[mode] + AFTER, timeout_s=300)
                assert client.post(f"/v1/jobs/{job['id']}/cancel").status_code == 200
            for mode, job in jobs.items():
                done = wait_for(client, job["id"], ("succeeded", "failed", "cancelled"), timeout_s=120)
                assert done["status"] == "cancelled", (mode, done, second.log_tail())
                rows[mode] = client.get(f"/v1/jobs/{job['id']}/metrics").json()["data"]
    finally:
        stop(second.process, 60)
    for mode in ("sync", "async"):
        steps = rows[mode]
        last = steps[-1]["step"]
        assert last >= killed_step[mode] + AFTER, (mode, last)
        assert [r["step"] for r in steps] == list(range(1, last + 1)), mode  # each step once, in order
        # the resumed run's values after the checkpoint, the killed run's before it
        assert all(r["time"] > killed_at for r in steps if r["step"] > resume_from[mode]), mode
        assert all(r["time"] < killed_at for r in steps if r["step"] <= resume_from[mode]), mode
    with sqlite3.connect(db) as conn:
        for job in jobs.values():
            dupes = conn.execute(
                "SELECT step FROM metrics WHERE job_id = ? GROUP BY step HAVING COUNT(*) > 1", (job["id"],)
            ).fetchall()
            assert dupes == []
    draws = [int(r["values"]["async/draw_index"]) for r in rows["async"]]
    assert draws == sorted(set(draws))  # no draw trained twice (one rollout worker: in order)
    assert all(r["values"]["async/staleness_max"] <= K for r in rows["async"])
