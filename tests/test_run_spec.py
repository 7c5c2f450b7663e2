"""`python -m controller.run_spec`, the RayJob entrypoint: spec loading, and a job run twice on one
folder (the second run, like a retried RayJob, resumes from the first run's checkpoint)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from pydantic import ValidationError

from controller.run_spec import load_spec, main

REPO = Path(__file__).resolve().parents[1]

TINY_JOB = """
method: grpo
model: {builtin: tiny-qwen2}
rollout: {n: 2, max_new_tokens: 4}
trainer: {total_steps: STEPS, prompts_per_step: 2, val_every: 0}
checkpoint: {every: 1, export_hf: false}
resources: {workers: 1}
"""


def test_load_spec_reads_yaml_and_json(tmp_path):
    (tmp_path / "job.yaml").write_text(
        "method: sft\nresources: {workers: 2, placement_strategy: STRICT_SPREAD}\n"
    )
    (tmp_path / "job.json").write_text(json.dumps({"method": "rloo", "trainer": {"total_steps": 3}}))
    assert load_spec(tmp_path / "job.yaml").resources.placement_strategy == "STRICT_SPREAD"
    assert load_spec(tmp_path / "job.json").trainer.total_steps == 3


def test_a_bad_spec_fails_before_ray_starts(tmp_path):
    (tmp_path / "job.yaml").write_text("resources: {placement_strategy: EVERYWHERE}\n")
    with pytest.raises(ValidationError, match="placement_strategy"):
        main([str(tmp_path / "job.yaml"), "--workdir", str(tmp_path / "job")])
    (tmp_path / "list.yaml").write_text("- method: grpo\n")
    with pytest.raises(ValueError, match="mapping"):
        load_spec(tmp_path / "list.yaml")


@pytest.mark.slow
def test_a_second_run_on_the_same_folder_resumes_from_the_checkpoint():
    with tempfile.TemporaryDirectory(prefix="trs-", dir="/tmp") as tmp:  # short: Ray's socket paths
        home, workdir = Path(tmp) / "home", Path(tmp) / "home" / "jobs" / "job"
        env = {**os.environ, "RAY_TMPDIR": tmp, "TANDEM_HOME": str(home), "PYTHONPATH": str(REPO)}
        env.pop("RAY_ADDRESS", None)
        for steps in (1, 2):
            spec = Path(tmp) / f"job-{steps}.yaml"
            spec.write_text(TINY_JOB.replace("STEPS", str(steps)))
            done = subprocess.run(
                [sys.executable, "-m", "controller.run_spec", str(spec), "--workdir", str(workdir)],
                cwd=REPO,
                env=env,
                capture_output=True,
                text=True,
                timeout=240,
            )
            assert done.returncode == 0, done.stderr[-5000:]
            result = json.loads(done.stdout.strip().splitlines()[-1])
            assert (result["status"], result["step"]) == ("succeeded", steps)
        events = [json.loads(line) for line in (workdir / "events.jsonl").read_text().splitlines()]
        resumed = [e for e in events if e["kind"] == "resumed"]
        assert [e["data"]["step"] for e in resumed] == [1]
        assert sorted(p.name for p in (workdir / "checkpoints").iterdir()) == [
            "step_00000001",
            "step_00000002",
        ]
