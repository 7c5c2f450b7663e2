"""examples/openenv_digits.yaml end to end on the tests' Ray: the job serves the example OpenEnv
server from a sandbox, its rollout workers step it through OpenEnv's client, and GRPO raises the
server's reward (the share of digits, which a random tiny model rarely writes) within 15 steps."""

from __future__ import annotations

from pathlib import Path

from api.cli_spec import build_spec
from controller.sink import JsonlSink
from controller.trainer import Trainer

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "openenv_digits.yaml"


def test_the_openenv_example_learns_on_its_server(ray_cluster, tmp_path, monkeypatch):
    monkeypatch.setenv("TANDEM_HOME", str(tmp_path / "home"))
    _, spec = build_spec(str(EXAMPLE))
    assert spec.rollout.environment.endswith("examples/openenv_server.py:app")
    sink = JsonlSink(tmp_path / "job")
    Trainer(spec, tmp_path / "job", sink, name="openenv").run()
    steps = [r["values"] for r in sink.history]
    assert all(s["multiturn/env_errors"] == 0 and s["multiturn/env_timeouts"] == 0 for s in steps)
    assert max(s["multiturn/num_turns/mean"] for s in steps) > 1  # the server's "More." came back
    scores = [s["critic/score/mean"] for s in steps]
    first, last = sum(scores[:3]) / 3, sum(scores[-3:]) / 3
    assert last > first + 0.15, scores
