"""verifiers environments as a job's agent (controller/agent_sandbox.py): the example environment,
written in verifiers 0.4.0's own format, learns; what is wrong with one is refused at submission, or
fails the job at its start, or is in the job's logs, naming the environment."""

from __future__ import annotations

import json
import math
import threading
import time
from pathlib import Path

import pytest

from api.cli_spec import build_spec
from controller.sink import JsonlSink
from controller.trainer import Trainer
from controller.user_code import UserCodeError, run_sandboxed
from tests.api_util import TERMINAL, tiny_job, wait_for

pytestmark = pytest.mark.usefixtures("ray_cluster")
EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "verifiers_arithmetic.yaml"


def verifiers_job(agent: str, args: object = None, **external) -> dict:
    extra = {} if args is None else {"agent_args": args}
    return tiny_job(
        model={"builtin": "tiny-qwen2-chat"},
        rollout={"source": "external", "free_cache_after_generate": False,
                 "external": {"group_size": 2, "trajectories_per_step": 2, "agent": agent, "agent_workers": 1,
                              **extra, **external}},
        trainer={"total_steps": 2, "val_every": 0, "samples_per_step": 2},
        checkpoint={"every": 0},
    )  # fmt: skip


def test_the_example_environment_learns(tmp_path, monkeypatch):
    """examples/verifiers_arithmetic.yaml as `tandem submit` builds it: the rubric's reward (correct +
    0.5 x share of digits) rises over its steps, every call scored by the rubric."""
    monkeypatch.setenv("TANDEM_HOME", str(tmp_path / "home"))
    _, spec = build_spec(str(EXAMPLE))
    sink = JsonlSink(tmp_path)
    trainer = Trainer(spec, tmp_path, sink, name="verifiers")
    trainer.run()
    # the run's end stops its agent pool (AgentSource.close): no thread left in this process
    assert not trainer.source.agents._thread.is_alive()
    assert not [t for t in threading.enumerate() if t.name == "tandem-agents"]
    scores = [r["values"]["critic/score/mean"] for r in sink.history if "critic/score/mean" in r["values"]]
    assert len(scores) == spec.trainer.total_steps
    third = len(scores) // 3
    first, last = sum(scores[:third]) / third, sum(scores[-third:]) / third
    print(f"verifiers example: rubric reward {first:.3f} -> {last:.3f}", [round(s, 3) for s in scores])
    # runs differ (the agents' calls interleave): 0.048 -> 0.167 and 0.115 -> 0.162 seen; a rise is asked
    assert last > first + 0.03, [round(s, 3) for s in scores]
    assert sink.history[-1]["values"]["external/agent_failures"] == 0


@pytest.mark.parametrize(
    ("agent", "args", "param"),
    [
        ("no_such_verifiers_env:Taskset", None, "rollout.external.agent"),  # not installed, not uploaded
        ("tests.verifiers_envs:BrokenTask", None, "rollout.external.agent"),  # a Task, not a Taskset
        ("tests.verifiers_envs:BrokenTaskset", "num_tasks=3", "rollout.external.agent_args"),  # not JSON
        ("tests.verifiers_envs:BrokenTaskset", {"x": math.nan}, "rollout.external.agent_args"),
        ("tests.verifiers_envs:BrokenTaskset", [1, 2], "rollout.external.agent_args"),
    ],
)
def test_a_bad_reference_or_arguments_are_refused_at_submission(api, agent, args, param):
    body = json.dumps(
        verifiers_job(agent, args)
    )  # NaN as JSON's extension token, as a careless client sends it
    refused = api.post("/v1/jobs", content=body, headers={"content-type": "application/json"})
    assert refused.status_code == 422, refused.text
    assert refused.json()["error"]["param"] == param, refused.text


@pytest.mark.parametrize(
    ("agent", "args", "says"),
    [
        ("examples.verifiers_arithmetic:ArithmeticTaskset", {"num_taks": 3}, "num_taks: Extra inputs"),
        ("examples.verifiers_arithmetic:ArithmeticTaskset", {"sampling": {"max_tokens": "x"}}, "max_tokens"),
        ("tests.verifiers_envs:ContainerTaskset", None, "need a container runtime"),
        ("tests.agent_fns:digits_agent", {"n": 1}, "is a function"),
    ],
)
def test_an_environment_that_cannot_run_is_refused_by_the_start_check(agent, args, says):
    """What the job checks once at its start, in a sandbox, before any agent worker runs."""
    with pytest.raises(UserCodeError, match=says):
        run_sandboxed("controller.agent_sandbox:check_agent", agent, [args], 120, f"agent '{agent}'")


@pytest.mark.slow  # the start check itself runs in make test (test_an_environment_that_cannot_run_is_refused_by_the_start_check)
def test_a_job_whose_environment_cannot_run_fails_at_its_start_naming_it(api):
    agent = "examples.verifiers_arithmetic:ArithmeticTaskset"
    job = api.post("/v1/jobs", json=verifiers_job(agent, {"num_taks": 3}))
    assert job.status_code == 201, job.text
    final = wait_for(api, job.json()["id"], TERMINAL, timeout_s=240)
    assert final["status"] == "failed" and "num_taks" in final["error"] and agent in final["error"], final


def logs_saying(api, job: str, texts: list[str], timeout_s: float = 240) -> list[str]:
    deadline, found = time.time() + timeout_s, {}
    while time.time() < deadline and len(found) < len(texts):
        lines = [r["line"] for r in api.get(f"/v1/jobs/{job}/logs", params={"tail": 500}).json()["data"]]
        found = {t: line for t in texts for line in lines if t in line}
        time.sleep(1)
    assert len(found) == len(texts), f"not all of {texts} in the logs of {job}: {lines[-40:]}"
    return list(found.values())


@pytest.mark.slow  # a call that never returns holds the job past agent_timeout_s, with room for a worker's start
def test_a_rubric_that_raises_or_never_returns_is_in_the_jobs_logs_naming_the_environment(api):
    # group_size 1: its two tasks alternate. The time limit counts a fresh worker's start (a sandbox
    # importing verifiers) too, so it leaves room for that
    agent = "tests.verifiers_envs:BrokenTaskset"
    spec = verifiers_job(agent, {"sampling": {"max_tokens": 2}}, agent_timeout_s=60, group_size=1)
    job = api.post("/v1/jobs", json=spec).json()
    try:
        for line in logs_saying(api, job["id"], ["rubric broke on purpose", "passed agent_timeout_s"]):
            assert agent in line, line
    finally:
        api.post(f"/v1/jobs/{job['id']}/cancel")
        wait_for(api, job["id"], TERMINAL, timeout_s=120)


def test_the_guide_shows_the_example_it_runs():
    """docs/guides/verifiers.md: its spec is examples/verifiers_arithmetic.yaml, which the learning test runs
    (its Python is checked against the file by tests/test_docs_pages.py)."""
    import re

    import yaml

    page = (EXAMPLE.parents[1] / "docs" / "guides" / "verifiers.md").read_text()
    shown = re.findall(r"```yaml\n(.*?)```", page, re.S)
    assert [yaml.safe_load(b) for b in shown] == [yaml.safe_load(EXAMPLE.read_text())]
