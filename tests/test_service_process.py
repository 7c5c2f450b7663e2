"""The process of a real `tandem serve`: its API process stays free of the training stack, and SIGTERM
pauses its running job, records why, and says so in its log.

The service (store, scheduler, requests) imports no torch, transformers or worker class: a job's
runner is imported in the job's own Ray actor (service/workloads.py). Checked through the real
process's own `sys.modules` (`GET /v1/service`) after it started, validated and ran a job. The two
tests share one `tandem serve` (its own local Ray takes a while to start): what the first reads is
taken when the service starts, before the second stops it.
"""

from __future__ import annotations

import json
import secrets
import shutil
import signal
import sqlite3
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.api_util import tiny_job, wait_for, wait_for_step
from tests.serve_util import Served, cluster_env, kill_leftovers, start_serve, stop

HEAVY = ("torch", "transformers", "tensordict", "workers.actor_role", "controller.job_actor")


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[Served, dict]]:
    """`tandem serve` on a fresh home that has validated and run a one-step job, with what its API
    process reported before and after (the SIGTERM test stops it; the end stops it otherwise)."""
    tmp = tempfile.mkdtemp(prefix="tsp-", dir="/tmp")  # short: Ray's socket paths have a length limit
    process = None
    try:
        serve = start_serve(Path(tmp), cluster_env(tmp), "tdm_" + secrets.token_hex(16), "serve")
        process = serve.process
        with serve.client() as api:
            seen = {"before": api.get("/v1/service").json()["modules"]}
            spec = tiny_job(trainer={"total_steps": 1})
            seen["validated"] = api.post("/v1/jobs/validate", json=spec).status_code
            job = api.post("/v1/jobs", json=spec).json()
            seen["job"] = wait_for(api, job["id"], ("succeeded", "failed"))
            seen["metrics"] = api.get(f"/v1/jobs/{job['id']}/metrics").json()["data"]
            seen["after"] = api.get("/v1/service").json()
            seen["version"] = api.get("/v1/version").json()
        yield serve, seen
    finally:
        if process is not None:
            stop(process, 60)
        kill_leftovers(tmp)
        shutil.rmtree(tmp, ignore_errors=True)


def test_the_api_process_never_imports_torch(served):
    _, seen = served
    assert {m: seen["before"][m] for m in HEAVY} == dict.fromkeys(HEAVY, False)
    assert seen["validated"] == 200
    assert seen["job"]["status"] == "succeeded", seen["job"]
    assert seen["metrics"], "the job recorded no step"
    info = seen["after"]
    assert {m: info["modules"][m] for m in HEAVY} == dict.fromkeys(HEAVY, False)
    assert info["rss_bytes"] > 0
    assert seen["version"]["torch"].startswith("2.")  # from package metadata


def test_sigterm_records_a_paused_event_per_job_and_logs_the_paused_ids(served):
    serve, _ = served
    try:
        with serve.client() as api:
            job = api.post("/v1/jobs", json=tiny_job(trainer={"total_steps": 4000})).json()["id"]
            assert wait_for_step(api, job, 1, timeout_s=300)["status"] == "running"
        serve.process.send_signal(signal.SIGTERM)
        assert serve.process.wait(300) == 0, serve.log_tail()
    finally:
        stop(serve.process, 60)
    with sqlite3.connect(f"file:{serve.home / 'tandem.db'}?mode=ro", uri=True, timeout=5) as db:
        events = db.execute(
            "SELECT kind, message, data FROM events WHERE job_id = ? ORDER BY id", (job,)
        ).fetchall()
        status = db.execute("SELECT status FROM jobs WHERE id = ?", (job,)).fetchone()[0]
    kinds = [kind for kind, _, _ in events]
    assert kinds[-2:] == ["paused", "requeued"] and status == "queued", events
    _, message, data = events[-2]
    assert "shutting down" in message and json.loads(data)["reason"] == "service_shutdown", events[-2]
    lines = [line for line in serve.log.read_text().splitlines() if "paused for the shutdown" in line]
    assert len(lines) == 1 and lines[0].endswith(job), serve.log_tail()
