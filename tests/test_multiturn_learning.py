"""The built-in environments learn on a CPU: bench/multiturn_learning.py's runs, asserted.

A test runs the bench's own setup (its `sft_spec` and `grpo_spec`, default steps and learning
rate): an SFT warm start on the environment's traces task, then multi-turn GRPO with the
environment, and asserts that the mean training reward of the last ten GRPO steps beats the first
ten's by the stated margin, about half the rise measured in bench/RESULTS.md ("Multi-turn
environments learning on a CPU"; calculator: 0.684 -> 0.763). guess_number is not here: it does not
learn in the bench's SFT setup (RESULTS.md says why); tests/test_examples.py runs its example, which
learns the game's format from random weights. Slow: ~30 minutes on two busy cores.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.multiturn_learning import SETUPS, grpo_spec, sft_spec
from controller.sink import JsonlSink
from controller.trainer import Trainer

pytestmark = [pytest.mark.slow, pytest.mark.timeout(3600)]  # beyond pyproject's 600 s per test
SFT_STEPS, GRPO_STEPS, VAL_EVERY, WINDOW = 300, 60, 10, 10


def grpo_rewards(env: str, workdir: Path) -> list[float]:
    """The training reward of every GRPO step after the bench's SFT warm start."""
    setup = SETUPS[env]
    Trainer(sft_spec(setup, SFT_STEPS), workdir / "sft", JsonlSink(workdir / "sft"), name=f"{env}-sft").run()
    spec = grpo_spec(setup, str(workdir / "sft" / "export"), GRPO_STEPS, VAL_EVERY)
    sink = JsonlSink(workdir / "grpo")
    Trainer(spec, workdir / "grpo", sink, name=f"{env}-grpo").run()
    return [r["values"]["critic/score/mean"] for r in sink.history if "critic/score/mean" in r["values"]]


@pytest.mark.parametrize(("env", "margin"), [("calculator", 0.04)])
def test_the_environments_training_reward_rises(ray_cluster, tmp_path, monkeypatch, env, margin):
    monkeypatch.setenv("TANDEM_HOME", str(tmp_path / "home"))
    rewards = grpo_rewards(env, tmp_path)
    assert len(rewards) == GRPO_STEPS
    first, last = sum(rewards[:WINDOW]) / WINDOW, sum(rewards[-WINDOW:]) / WINDOW
    assert last >= first + margin, rewards
