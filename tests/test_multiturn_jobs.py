"""Multi-turn jobs end to end on a real local Ray: one short GRPO job per built-in environment.

Each runs two steps on the built-in chat model; the environment's reward is the score, the
multiturn/ metrics are recorded, and the update runs on the masked layout (finite loss and gradient).
"""

from __future__ import annotations

import math

import pytest

from controller.sink import JsonlSink
from controller.trainer import Trainer
from schema.job import JobSpec


def env_spec(environment: str, task: str) -> JobSpec:
    return JobSpec.model_validate(
        {
            "method": "grpo",
            "model": {"builtin": "tiny-qwen2-chat"},
            "data": {"builtin_task": task},
            "rollout": {
                "environment": environment,
                "n": 2,
                "max_new_tokens": 6,
                "max_turns": 3,
                "max_response_tokens": 48,
            },
            "trainer": {"total_steps": 2, "prompts_per_step": 2, "val_every": 2, "val_size": 2},
            "optim": {"lr": 1e-3},
            "checkpoint": {"every": 0, "export_hf": False},
        }
    )


@pytest.mark.parametrize(("environment", "task"), [("builtin:calculator", "calculator"),
                                                   ("builtin:guess_number", "guess_number")])  # fmt: skip
def test_environment_job_runs_and_records_multiturn_metrics(
    ray_cluster, tmp_path, monkeypatch, environment, task
):
    monkeypatch.setenv("TANDEM_HOME", str(tmp_path / "home"))
    sink = JsonlSink(tmp_path / "job")
    last = Trainer(env_spec(environment, task), tmp_path / "job", sink, name=task).run()
    assert 1 <= last["multiturn/num_turns/mean"] <= last["multiturn/num_turns/max"] <= 3
    assert 0 <= last["multiturn/truncated_ratio"] <= 1
    assert last["multiturn/env_errors"] == 0 and last["multiturn/env_timeouts"] == 0
    assert last["critic/score/mean"] == pytest.approx(last["multiturn/reward/mean"])
    assert math.isfinite(last["actor/pg_loss"]) and math.isfinite(last["actor/grad_norm"])
    assert "val/multiturn/num_turns/mean" in last


def test_the_overlong_penalty_of_a_trajectory_uses_its_response_token_budget(
    ray_cluster, tmp_path, monkeypatch
):
    """Buffer = budget = max_response_tokens 48: a trajectory of L tokens after its prompt loses
    exactly L / 48, so the mean penalty is -response_length/mean / 48 (measured against
    max_new_tokens = 6 it would be -(L + 42) / 48, and the spec would refuse the buffer)."""
    monkeypatch.setenv("TANDEM_HOME", str(tmp_path / "home"))
    spec = env_spec("builtin:guess_number", "guess_number").merged(
        {
            "trainer": {"total_steps": 1, "val_every": 0},
            "algorithm": {"overlong": {"penalty_buffer": 48, "penalty_factor": 1.0}},
        }
    )
    last = Trainer(spec, tmp_path / "job", JsonlSink(tmp_path / "job"), name="overlong").run()
    assert last["response_length/mean"] > 6  # several turns: longer than one response's budget
    assert last["overlong/penalty_mean"] == pytest.approx(-last["response_length/mean"] / 48, abs=1e-6)
