"""Async RL, the long runs: `tandem serve` killed with SIGKILL mid-job in async mode, then started again.

The job resumes from its last checkpoint; the buffered and in-flight samples are regenerated from the
checkpoint's data position (controller/async_loop.py), so every step is stored once and no draw of
the loader is trained twice, and every trained sample stays within the staleness bound.
"""

from __future__ import annotations

import os
import secrets
import signal
import time
from pathlib import Path

import pytest

from controller import checkpoints
from tests.api_util import tiny_job, wait_for, wait_for_step
from tests.serve_util import stop, wait_until
from tests.test_serve_crash import PACED, crash_dir, recorded_step, start_serve  # noqa: F401 -- the fixture

pytestmark = pytest.mark.slow
TOTAL, EVERY, K = 10, 4, 1


def test_kill_9_mid_async_job_then_restart_trains_each_step_and_draw_once(crash_dir):  # noqa: F811
    root, env = crash_dir
    token = "tdm_" + secrets.token_urlsafe(24)
    first = start_serve(root, env, token, "first")
    spec = tiny_job(
        reward={"function": PACED},
        trainer={"total_steps": TOTAL, "mode": "async", "max_staleness": K},
        checkpoint={"every": EVERY, "keep_last": 5},
        resources={"placement": "split", "workers": 1, "rollout": {"workers": 1}},
        metadata={"suite": "crash"},
    )
    try:
        with first.client() as client:
            job = client.post("/v1/jobs", json=spec).json()
            assert "id" in job, job
            wait_for_step(client, job["id"], EVERY, timeout_s=300)
        db = root / "home" / "tandem.db"
        wait_until(
            lambda: recorded_step(db, job["id"]) > EVERY, "no step past the checkpoint", 90, [first.log]
        )
        os.kill(first.process.pid, signal.SIGKILL)
        first.process.wait(10)
        killed_at = time.time()
    finally:
        stop(first.process, 10)
    resume_from = checkpoints.complete(Path(job["outputs"]["workdir"]))[-1][0]

    second = start_serve(root, env, token, "second")
    try:
        with second.client() as client:
            done = wait_for(client, job["id"], ("succeeded", "failed", "cancelled"), timeout_s=400)
            assert done["status"] == "succeeded", second.log_tail()
            rows = client.get(f"/v1/jobs/{job['id']}/metrics").json()["data"]
    finally:
        stop(second.process, 60)
    assert [r["step"] for r in rows] == list(range(1, TOTAL + 1))  # each step once
    assert all(r["time"] > killed_at for r in rows if r["step"] > resume_from)
    draws = [int(r["values"]["async/draw_index"]) for r in rows]
    assert draws == sorted(set(draws))  # no draw trained twice (one lane: in order)
    assert all(r["values"]["async/staleness_max"] <= K for r in rows)
