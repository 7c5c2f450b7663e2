"""SIGTERM to a real `tandem serve` pauses its running job, records why, and says so in its log."""

from __future__ import annotations

import json
import secrets
import signal
import sqlite3

from tests.api_util import tiny_job, wait_for_step
from tests.serve_util import stop
from tests.test_serve_crash import crash_dir, start_serve  # noqa: F401  (crash_dir is a fixture)


def test_sigterm_records_a_paused_event_per_job_and_logs_the_paused_ids(crash_dir):  # noqa: F811
    root, env = crash_dir
    served = start_serve(root, env, "tdm_" + secrets.token_hex(16), "serve")
    try:
        with served.client() as api:
            job = api.post("/v1/jobs", json=tiny_job(trainer={"total_steps": 4000})).json()["id"]
            assert wait_for_step(api, job, 1, timeout_s=300)["status"] == "running"
        served.process.send_signal(signal.SIGTERM)
        assert served.process.wait(300) == 0, served.log_tail()
    finally:
        stop(served.process, 60)
    with sqlite3.connect(f"file:{served.home / 'tandem.db'}?mode=ro", uri=True, timeout=5) as db:
        events = db.execute(
            "SELECT kind, message, data FROM events WHERE job_id = ? ORDER BY id", (job,)
        ).fetchall()
        status = db.execute("SELECT status FROM jobs WHERE id = ?", (job,)).fetchone()[0]
    kinds = [kind for kind, _, _ in events]
    assert kinds[-2:] == ["paused", "requeued"] and status == "queued", events
    _, message, data = events[-2]
    assert "shutting down" in message and json.loads(data)["reason"] == "service_shutdown", events[-2]
    lines = [line for line in served.log.read_text().splitlines() if "paused for the shutdown" in line]
    assert len(lines) == 1 and lines[0].endswith(job), served.log_tail()
