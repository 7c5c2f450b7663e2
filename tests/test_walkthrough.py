"""examples/walkthrough.sh, the curl tour of the REST API, run against a live service to the end."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from tests.api_util import start_service

REPO = Path(__file__).resolve().parents[1]
STAGES = (
    "health",
    "submit",
    "watch",
    "pause",
    "resume",
    "fork",
    "change a hyper-parameter",
    "cancel",
    "done",
)


@pytest.fixture(scope="module")
def live(ray_cluster, tmp_path_factory):
    svc = start_service(tmp_path_factory.mktemp("walkthrough-service"))
    yield svc
    svc.stop()


# make test-slow: every stage is a REST call that tests/test_api.py::
# test_pause_resume_hyperparameters_fork_and_cancel makes in make test; this runs the script as written.
@pytest.mark.slow
def test_walkthrough_runs_every_stage(live):
    env = {**os.environ, "TANDEM_URL": live.url, "TANDEM_TOKEN": live.token, "WAIT_S": "150"}
    run = subprocess.run(["bash", str(REPO / "examples" / "walkthrough.sh")], env=env, capture_output=True,
                         text=True, timeout=420)  # fmt: skip
    out = run.stdout
    assert run.returncode == 0, f"stdout:\n{out}\nstderr:\n{run.stderr}"
    headings = [line[4:] for line in out.splitlines() if line.startswith("==> ")]
    for stage in STAGES:
        assert any(h.startswith(stage) for h in headings), (stage, headings)
    job_id = next(line.split()[1] for line in out.splitlines() if line.startswith("submitted "))
    assert f"{job_id}: paused" in out and f"{job_id}: queued" in out and f"{job_id}: cancelled" in out
    assert "0.0005" in out and "requested for the next step: {'lr': 0.0005}" in out
    assert "succeeded, step" in out  # the fork ran its one step
    assert run.stderr == ""
