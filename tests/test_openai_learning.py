"""A job fed only by examples/agent_openai.py (the plain `openai` SDK) learns: the digits reward of
the arithmetic task rises from random weights, 0.118 (steps 1-5) -> 0.983 (steps 26-30) in 3.5 min at
load 15 (slow; tests/test_openai_endpoint.py has the short version: three steps trained on what
concurrent agents report)."""

from __future__ import annotations

import pytest

from examples import agent_openai
from tests.api_util import TERMINAL, tiny_job, wait_for, wait_for_step
from tests.test_openai_endpoint import wait_for_endpoint

pytestmark = [pytest.mark.usefixtures("ray_cluster"), pytest.mark.slow]

STEPS, PROBLEMS, GROUP = 30, 4, 4


def test_a_job_fed_by_the_agent_script_raises_its_reward(live, api):
    spec = tiny_job(
        model={"builtin": "tiny-qwen2-chat"},
        rollout={"source": "external", "external": {"group_size": GROUP, "trajectories_per_step": PROBLEMS * GROUP},
                 "free_cache_after_generate": False},
        trainer={"total_steps": STEPS, "val_every": 0},
        optim={"lr": 5e-3},
        checkpoint={"every": 0},
    )  # fmt: skip
    job = api.post("/v1/jobs", json=spec).json()["id"]
    wait_for_endpoint(api, job)
    means = []
    for step in range(1, STEPS + 1):
        rewards = agent_openai.main([
            "--url", live.url, "--job", job, "--key", live.token, "--task", "arithmetic", "--reward", "digits",
            "--problems", str(PROBLEMS), "--group-size", str(GROUP), "--agents", "8", "--max-tokens", "8",
            "--seed", str(step),
        ])  # fmt: skip
        means.append(sum(rewards) / len(rewards))
        wait_for_step(api, job, step, timeout_s=300)
    assert wait_for(api, job, TERMINAL, timeout_s=120)["status"] == "succeeded"
    first, last = sum(means[:5]) / 5, sum(means[-5:]) / 5
    print(f"digits reward: steps 1-5 {first:.3f} -> steps {STEPS - 4}-{STEPS} {last:.3f}")
    assert last > first + 0.3 and last > 0.5, means  # measured: 0.118 -> 0.983 (load 15)
