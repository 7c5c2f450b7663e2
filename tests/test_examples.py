"""Every example spec in examples/ learns something visible in its own step count.

Each spec is loaded the way `tandem submit` loads it (relative reward files made absolute) and run
to its end with the Trainer on the tests' local Ray. The train reward of its last steps must be
clearly above that of its first steps. The demo's two specs (sft_arithmetic, grpo_arithmetic) take
minutes; their three-seed curves are in bench/RESULTS.md, and the SFT stage is checked here too.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from api.cli_spec import load_spec_file
from controller.sink import JsonlSink
from controller.spec import JobSpec
from controller.trainer import Trainer

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"

pytestmark = pytest.mark.slow


@pytest.fixture(autouse=True)
def _home(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("TANDEM_HOME", str(tmp_path_factory.getbasetemp() / "home"))


def run_example(name: str, workdir: Path, **overrides) -> list[dict]:
    spec = JobSpec.model_validate(load_spec_file(EXAMPLES / f"{name}.yaml")).merged(overrides)
    sink = JsonlSink(workdir)
    Trainer(spec, workdir, sink, name=workdir.name).run()
    return sink.history


def rise(history: list[dict], key: str) -> tuple[float, float]:
    """Mean of `key` over the first and over the last third of the steps that report it."""
    values = [r["values"][key] for r in history if r["step"] and r["values"].get(key) is not None]
    third = max(len(values) // 3, 1)
    return sum(values[:third]) / third, sum(values[-third:]) / third


@pytest.mark.parametrize(
    ("name", "margin"),
    [
        ("grpo_tiny", 0.1),
        ("custom_reward", 0.1),
        ("ppo_critic", 0.1),
        ("dapo_tiny", 0.1),
        ("custom_env", 0.1),
    ],
)
def test_example_reward_rises(ray_cluster, tmp_path, name, margin):
    history = run_example(name, tmp_path, checkpoint={"every": 0, "export_hf": False})
    first, last = rise(history, "critic/score/mean")
    assert last > first + margin, [round(r["values"].get("critic/score/mean", -1), 3) for r in history]


def test_sft_arithmetic_accuracy_rises(ray_cluster, tmp_path):
    history = run_example("sft_arithmetic", tmp_path)
    accuracy = [r["values"]["val/accuracy"] for r in history if "val/accuracy" in r["values"]]
    assert accuracy[0] < 0.05 and accuracy[-1] > 0.2, accuracy
