"""The environment example as a reader meets it: the guide shows examples/my_env.py's tutor as the
file has it, and examples/custom_env.yaml's budget leaves room for every turn it allows."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import yaml

from api.cli_spec import build_spec
from controller.sink import JsonlSink
from controller.trainer import Trainer

ROOT = Path(__file__).resolve().parents[1]
GUIDE = ROOT / "docs" / "guides" / "environments.md"


def guide_block(header: str) -> str:
    """The body of the guide's fenced block whose first line is `header`."""
    blocks = re.findall(r"```\w*\n(.*?)```", GUIDE.read_text(), re.S)
    return next(b for b in blocks if b.startswith(header + "\n")).removeprefix(header + "\n")


def test_the_guides_tutor_is_the_example_files_tutor():
    source = (ROOT / "examples" / "my_env.py").read_text()
    tutor = next(n for n in ast.parse(source).body if isinstance(n, ast.ClassDef) and n.name == "TutorEnv")
    assert guide_block("# examples/my_env.py") == ast.get_source_segment(source, tutor) + "\n"


def test_the_guides_rollout_settings_are_the_examples():
    shown = yaml.safe_load(guide_block("rollout:").join(["rollout:\n", ""]))["rollout"]
    example = yaml.safe_load((ROOT / "examples" / "custom_env.yaml").read_text())["rollout"]
    for key in ("max_turns", "max_response_tokens"):
        assert shown[key] == example[key], key


def test_a_short_custom_env_run_reaches_the_third_turn(ray_cluster, tmp_path, monkeypatch):
    """A random model rarely answers right, so most tutor trajectories ask for every turn they may."""
    monkeypatch.setenv("TANDEM_HOME", str(tmp_path / "home"))
    _, spec = build_spec(str(ROOT / "examples" / "custom_env.yaml"))
    spec = spec.merged(
        {"trainer": {"total_steps": 1, "prompts_per_step": 2}, "checkpoint": {"export_hf": False}}
    )
    sink = JsonlSink(tmp_path / "job")
    Trainer(spec, tmp_path / "job", sink, name="custom-env-turns").run()
    (step,) = [r["values"] for r in sink.history if r["step"] == 1]
    assert step["multiturn/num_turns/max"] == spec.rollout.max_turns == 3, step
