"""Trajectory samples through the service: a user environment from a file runs as an API job, its
samples come back from GET /v1/jobs/{id}/samples (a cursor list) and `tandem samples`, a
single-turn job gets the same view, and a bad environment is refused at submission."""

from __future__ import annotations

import json

import pytest

from tests.api_util import tiny_job, wait_for
from tests.owners_util import upload
from tests.test_cli import REPO, tandem

TERMINAL = ("succeeded", "failed", "cancelled")


@pytest.fixture(scope="module")
def env_job(live, api):
    rows = "".join(json.dumps({"prompt": w, "ground_truth": ""}) + "\n" for w in ("cat", "dog", "sun"))
    data = upload(api, "rhymes.jsonl", rows.encode())["id"]  # the submitter's own upload
    spec = tiny_job(
        model={"builtin": "tiny-qwen2-chat"},
        data={"train_path": data, "builtin_task": None},
        rollout={
            "n": 2,
            "max_new_tokens": 6,
            "environment": f"{REPO}/examples/my_env.py:RhymeEnv",
            "max_turns": 3,
            "max_response_tokens": 64,
        },  # fmt: skip
        trainer={"total_steps": 2, "prompts_per_step": 2, "val_every": 0, "samples_per_step": 3},
    )
    created = api.post("/v1/jobs", json=spec)
    assert created.status_code == 201, created.text
    job = wait_for(api, created.json()["id"], TERMINAL, timeout_s=300)
    assert job["status"] == "succeeded", job
    return job


def test_samples_of_a_user_environment_job(api, env_job):
    page = api.get(f"/v1/jobs/{env_job['id']}/samples", params={"step": 2}).json()
    assert page["object"] == "list" and not page["has_more"] and len(page["data"]) == 3
    for sample in page["data"]:
        assert sample["step"] == 2 and sample["prompt"].startswith("user: Say a word that rhymes with")
        roles = [t["role"] for t in sample["turns"]]
        assert roles[0] == "assistant" and roles.count("assistant") <= 3
        assert sample["finish_reason"] in ("done", "max_turns", "budget")
        assert sample["tokens"]["trained"] == sum(s["tokens"] for s in sample["spans"] if s["trained"])
        assert sample["tokens"]["response"] == sum(s["tokens"] for s in sample["spans"])
    metrics = api.get(f"/v1/jobs/{env_job['id']}/metrics", params={"keys": "multiturn/num_turns/mean"}).json()
    assert [row["step"] for row in metrics["data"]] == [1, 2]

    # Cursor pages: two of three, then the rest after the last id.
    first = api.get(f"/v1/jobs/{env_job['id']}/samples", params={"limit": 2}).json()
    assert first["has_more"] and [s["step"] for s in first["data"]] == [1, 1]
    rest = api.get(f"/v1/jobs/{env_job['id']}/samples", params={"after": first["data"][-1]["id"]}).json()
    assert len(rest["data"]) == 4 and not rest["has_more"]


def test_cli_prints_a_step_as_a_chat(live, env_job):
    out = tandem(live, "samples", env_job["id"], "--step", "1")
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("── step 1 · sample") == 3 and "[assistant]" in out.stdout
    latest = tandem(live, "samples", env_job["id"], "--json")
    assert {row["step"] for row in json.loads(latest.stdout)} == {2}


def test_single_turn_jobs_store_prompt_response_and_reward(api, error_jobs):
    # The raising reward's job is a plain single-turn job whose samples are not scored (no reward, no
    # token trained): it is read here rather than a third job started (workers take most of a run to start).
    job = wait_for(api, error_jobs["reward"], TERMINAL, timeout_s=300)
    assert job["status"] == "succeeded"
    rows = api.get(f"/v1/jobs/{job['id']}/samples").json()["data"]
    assert len(rows) == 2
    for row in rows:
        assert [t["role"] for t in row["turns"]] == ["assistant"] and row["finish_reason"] in (
            "stop",
            "length",
        )
        assert row["tokens"]["trained"] == 0 < row["tokens"]["response"] <= 4
        assert "=" in row["prompt"] and row["reward"] is None


RAISING_REWARD = b"""
def score(prompt, response, ground_truth, extra):
    raise ValueError(f"reward broke on purpose for {prompt!r}")
"""
RAISING_ENV = b"""
class Env:
    def reset(self, row):
        return "say something"

    def step(self, text):
        raise KeyError("the environment broke on purpose")
"""


@pytest.fixture(scope="module")
def error_jobs(live, api) -> dict[str, str]:
    """Two one-step jobs submitted together, one with a raising reward, one with a raising environment."""
    reward = upload(api, "raising_reward.py", RAISING_REWARD)["id"]
    env = live.service.files.path(upload(api, "raising_env.py", RAISING_ENV)["id"])  # by path
    steps = {"total_steps": 1, "samples_per_step": 2, "val_every": 0}
    specs = {
        "reward": tiny_job(reward={"function": f"{reward}:score"}, trainer=steps),
        "environment": tiny_job(model={"builtin": "tiny-qwen2-chat"}, trainer=steps,
                                rollout={"environment": f"{env}:Env", "max_turns": 2, "max_response_tokens": 32}),
    }  # fmt: skip
    ids = {}
    for kind, spec in specs.items():
        created = api.post("/v1/jobs", json=spec)
        assert created.status_code == 201, created.text
        ids[kind] = created.json()["id"]
    return ids


def test_reward_and_environment_errors_reach_the_log_and_the_samples(api, error_jobs):
    """A failing user function's rows are not scored (no reward, no token trained) and the job goes on;
    what it raised is in the job's log (the first few per step) and on each stored sample it failed on."""
    ids = error_jobs
    for kind, words in (("reward", "ValueError: reward broke on purpose for"),
                        ("environment", "KeyError: 'the environment broke on purpose'")):  # fmt: skip
        job = wait_for(api, ids[kind], TERMINAL, timeout_s=300)
        assert job["status"] == "succeeded", job
        lines = [row["line"] for row in api.get(f"/v1/jobs/{job['id']}/logs").json()["data"]]
        failed = [line for line in lines if words in line]
        assert failed and f"{kind} " in failed[0], lines[-20:]
        samples = api.get(f"/v1/jobs/{job['id']}/samples").json()["data"]
        assert len(samples) == 2 and all(words in sample["error"] for sample in samples), samples
        assert all(sample["reward"] is None and sample["tokens"]["trained"] == 0 for sample in samples)


def test_a_bad_environment_is_refused_at_submission(live, api):
    code = b"class Env:\n    def __init__(self, level):\n        pass\n"
    bad = live.service.files.path(upload(api, "bad_env.py", code)["id"])  # one's own upload, by path
    for ref, words in (
        (f"{bad}:Env", "constructible without arguments"),
        ("builtin:chess", "not a built-in"),
    ):
        response = api.post("/v1/jobs", json=tiny_job(rollout={"environment": ref}))
        assert response.status_code == 422, response.text
        error = response.json()["error"]
        assert error["param"] == "rollout.environment" and words in error["message"]
