"""The `tandem` CLI as a user runs it: a subprocess against a live service (uvicorn, the tests' Ray)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.api_util import free_port, tiny_job, wait_for, wait_for_step

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "examples"
# The tiny GRPO example, made tinier: 2 steps of 4 prompts, validation every step on 8 prompts.
FAST = ["--steps", "2", "--set", "trainer.prompts_per_step=4", "--set", "trainer.val_every=1",
        "--set", "trainer.val_size=8", "--set", "checkpoint.every=1"]  # fmt: skip


def tandem(live, *args: str, url: str | None = None, token: str | None = None, timeout: float = 600):
    env = {**os.environ, "TANDEM_URL": url or (live.url if live else ""), "TANDEM_TOKEN": token or "",
           "TANDEM_HOME": "/nonexistent"}  # fmt: skip
    if live and token is None:
        env["TANDEM_TOKEN"] = live.token
    return subprocess.run([sys.executable, "-m", "api.cli", *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=timeout)  # fmt: skip


@pytest.fixture(scope="module")
def finished(live):
    """A job submitted from examples/grpo_tiny.yaml and followed to completion."""
    export = ["--set", "checkpoint.export_hf=true"]  # the example exports nothing; the summary names it
    done = tandem(live, "submit", str(EXAMPLES / "grpo_tiny.yaml"), *FAST, *export, "--follow")
    assert done.returncode == 0, done.stderr
    job_id = done.stdout.splitlines()[0]
    return job_id, done


def test_submit_follow_shows_progress_to_the_last_step(finished):
    job_id, done = finished
    assert job_id.startswith("job")
    assert f"{job_id} step 2/2" in done.stderr and "100%" in done.stderr and "val_acc=" in done.stderr
    assert f"job {job_id} succeeded at step 2/2" in done.stdout
    export = Path(done.stdout.split("\nexport: ")[1].strip())  # the next stage's --model
    assert export.name == "export" and (export / "config.json").is_file() and job_id in str(export)


def test_list_and_status(live, finished):
    job_id, _ = finished
    listed = tandem(live, "list")
    assert listed.returncode == 0
    header, *rows = listed.stdout.splitlines()
    assert header.split()[:6] == ["ID", "STATUS", "OWNER", "METHOD", "MODEL", "STEP"]
    row = next(r for r in rows if r.startswith(job_id)).split()
    assert row[1:6] == ["succeeded", "admin", "grpo", "tiny-qwen2", "2/2"]
    as_json = json.loads(tandem(live, "list", "--status", "succeeded", "--json").stdout)
    assert job_id in [j["id"] for j in as_json]
    assert job_id not in tandem(live, "list", "--status", "failed").stdout
    status = tandem(live, "status", job_id)
    assert status.returncode == 0
    facts = dict(line.split(None, 1) for line in status.stdout.splitlines())
    assert facts["status"] == "succeeded" and facts["step"].startswith("2/2") and "val/accuracy" in facts
    assert json.loads(tandem(live, "status", job_id, "--json").stdout)["status"] == "succeeded"


def test_logs_events_metrics_checkpoints(live, finished):
    job_id, _ = finished
    logs = tandem(live, "logs", job_id, "--tail", "50")
    assert logs.returncode == 0 and "step 2/2" in logs.stdout
    events = tandem(live, "events", job_id)
    kinds = [line.split()[2] for line in events.stdout.splitlines()]
    assert events.returncode == 0 and kinds[0] == "created" and kinds[-1] == "succeeded"
    followed = tandem(live, "events", job_id, "-f")  # a terminal job's stream ends by itself
    assert followed.returncode == 0 and followed.stdout == events.stdout
    assert "step 2/2" in tandem(live, "logs", job_id, "-f").stdout
    metrics = tandem(live, "metrics", job_id)
    header, *rows = metrics.stdout.splitlines()
    assert header.split()[:3] == ["STEP", "critic/score/mean", "val/accuracy"]
    assert [r.split()[0] for r in rows] == ["0", "1", "2"]  # step 0: validation before training
    picked = json.loads(tandem(live, "metrics", job_id, "--keys", "actor/lr", "--json").stdout)
    assert [set(r["values"]) for r in picked if r["step"]] == [{"actor/lr"}, {"actor/lr"}]
    saved = tandem(live, "checkpoints", job_id)
    assert saved.returncode == 0 and [r.split()[0] for r in saved.stdout.splitlines()[1:]] == ["1", "2"]


def test_steering_a_running_job(live, api):
    submitted = tandem(live, "submit", "--model", "tiny-qwen2", "--steps", "4000", "--set",
                       "reward.function=tests.reward_fns:digit_reward", "--set", "trainer.val_every=0",
                       "--set", "trainer.prompts_per_step=4", "--set", "rollout.n=4",
                       "--set", "checkpoint.keep_last=50", "--set", "checkpoint.every=1")  # fmt: skip
    assert submitted.returncode == 0, submitted.stderr
    job_id = submitted.stdout.strip()
    wait_for_step(api, job_id, 1)
    changed = tandem(live, "set", job_id, "lr=5e-4", "temperature=0.9")
    assert changed.returncode == 0 and "lr=0.0005" in changed.stdout
    assert "hyperparameters_requested" in tandem(live, "events", job_id).stdout
    refused = tandem(live, "set", job_id, "max_new_tokens=9")
    assert refused.returncode == 2 and "max_new_tokens" in refused.stderr
    paused = tandem(live, "pause", job_id)
    assert paused.returncode == 0 and paused.stdout.split()[-1] in ("pausing", "paused")
    step = wait_for(api, job_id, ("paused",))["step"]
    bad_fork = tandem(live, "fork", job_id, "--set", "trainer.total_steps=0")
    assert bad_fork.returncode == 2 and "trainer.total_steps" in bad_fork.stderr
    nothing_left = tandem(live, "fork", job_id, "--step", str(step), "--steps", str(step))
    assert nothing_left.returncode == 2 and "`tandem fork --steps N`" in nothing_left.stderr
    forked = tandem(live, "fork", job_id, "--step", str(step), "--steps", str(step + 1))
    assert forked.returncode == 0, forked.stderr
    child_id = forked.stdout.strip()
    assert api.get(f"/v1/jobs/{child_id}").json()["parent_id"] == job_id
    assert tandem(live, "resume", job_id).stdout.strip() == f"{job_id}: queued"
    assert tandem(live, "cancel", job_id).stdout.split()[-1] in ("cancelling", "cancelled")
    assert tandem(live, "cancel", child_id).returncode == 0
    wait_for(api, job_id, ("cancelled",))
    followed = tandem(live, "follow", job_id)
    assert followed.returncode == 1 and f"job {job_id} cancelled" in followed.stderr
    again = tandem(live, "resume", job_id)
    assert (
        again.returncode == 1 and again.stderr.startswith("tandem: error: ") and "cancelled" in again.stderr
    )


@pytest.mark.slow  # README.md's page test runs `tandem pause --wait` in make test
def test_pause_and_cancel_wait_return_once_the_job_has_stopped(live, api):
    """`--wait` returns only once the job left `pausing` / `cancelling` (at a step boundary), so the
    next command finds it paused or cancelled."""
    submitted = tandem(live, "submit", "--model", "tiny-qwen2", "--steps", "4000", "--set",
                       "trainer.val_every=0", "--set", "trainer.prompts_per_step=4", "--set", "rollout.n=4",
                       "--set", "checkpoint.every=1")  # fmt: skip
    assert submitted.returncode == 0, submitted.stderr
    job_id = submitted.stdout.strip()
    wait_for_step(api, job_id, 1)
    paused = tandem(live, "pause", job_id, "--wait")
    assert paused.returncode == 0 and paused.stdout.strip() == f"{job_id}: paused", paused.stderr
    job = api.get(f"/v1/jobs/{job_id}").json()
    assert job["status"] == "paused"
    assert tandem(live, "resume", job_id).returncode == 0
    wait_for_step(api, job_id, job["step"] + 1)  # running again, past its start-up: it stops at a step's end
    cancelled = tandem(live, "cancel", job_id, "--wait")
    assert cancelled.returncode == 0 and cancelled.stdout.strip() == f"{job_id}: cancelled", cancelled.stderr
    assert api.get(f"/v1/jobs/{job_id}").json()["status"] == "cancelled"


def test_a_bad_spec_is_one_line_naming_the_field(live, tmp_path):
    spec = tmp_path / "bad.yaml"
    spec.write_text("method: grpo\ntrainer:\n  total_steps: 0\n")
    bad = tandem(live, "submit", str(spec))
    assert bad.returncode == 2
    assert bad.stderr.splitlines() == ["tandem: error: trainer.total_steps: Input should be greater than 0"]
    typo = tandem(live, "submit", str(spec), "--steps", "3", "--set", "trainer.total_step=3")
    assert typo.returncode == 2 and "trainer.total_step: Extra inputs are not permitted" in typo.stderr
    server_side = tandem(
        live, "submit", "--set", "reward.function=no_such_module:f"
    )  # checked by the service
    assert server_side.returncode == 2 and server_side.stderr.startswith("tandem: error: reward.function: ")
    missing = tandem(live, "status", "job-0123456789ab")
    assert missing.returncode == 1 and "no job 'job-0123456789ab'" in missing.stderr


def test_connection_and_auth_errors(live):
    url = f"http://127.0.0.1:{free_port()}"
    down = tandem(None, "list", url=url, token="x")
    assert down.returncode == 1 and len(down.stderr.splitlines()) == 1
    assert f"cannot reach the Tandem service at {url}" in down.stderr and "tandem serve" in down.stderr
    denied = tandem(live, "list", token="tdm_wrong")
    assert (
        denied.returncode == 1 and "invalid bearer token" in denied.stderr and "TANDEM_TOKEN" in denied.stderr
    )


@pytest.mark.parametrize("name", ["grpo_tiny", "ppo_critic", "custom_reward"])
def test_example_specs_validate(live, name):
    from controller.rewards import load_reward_fn

    shown = tandem(live, "submit", str(EXAMPLES / f"{name}.yaml"), "--dry-run")
    assert shown.returncode == 0, shown.stderr
    spec = json.loads(shown.stdout)
    assert spec["model"]["builtin"] and load_reward_fn(spec["reward"]["function"])
    if name == "custom_reward":
        assert spec["reward"]["function"] == f"{EXAMPLES / 'my_reward.py'}:score"


@pytest.mark.parametrize("name", ["grpo_calculator", "grpo_guess_number", "custom_env"])
def test_environment_example_specs_validate(name):
    from api.cli_spec import build_spec
    from controller.user_code import check_callable

    # Local validation only (the CLI's own step): the service would refuse words.jsonl outside its
    # allowed folders, which is the operator's choice, not the spec's fault.
    spec = build_spec(str(EXAMPLES / f"{name}.yaml"))[1].model_dump(mode="json")
    assert check_callable(spec["rollout"]["environment"], "environment") is None
    if name == "custom_env":
        assert spec["rollout"]["environment"] == f"{EXAMPLES / 'my_env.py'}:TutorEnv"


def test_set_paths_are_read_from_the_current_folder(tmp_path, monkeypatch):
    """`--set` resolves a relative file against the working directory, as a spec file's own values
    are resolved against its folder; a relative file that is not there is named before sending."""
    from api.cli_spec import SpecError, build_spec

    (tmp_path / "my_env.py").write_text((EXAMPLES / "my_env.py").read_text())
    monkeypatch.chdir(tmp_path)
    given, _ = build_spec(str(EXAMPLES / "custom_env.yaml"), sets=["rollout.environment=my_env.py:TutorEnv"])
    assert given["rollout"]["environment"] == f"{tmp_path / 'my_env.py'}:TutorEnv"
    with pytest.raises(SpecError, match=r"^reward\.function: no file 'gone\.py' in "):
        build_spec(str(EXAMPLES / "grpo_tiny.yaml"), sets=["reward.function=gone.py:score"])


def test_models_lists_the_built_in_names():
    from controller.models import BUILTIN_MODEL_NAMES

    for argv in (["models"], ["models", "list"]):
        shown = tandem(None, *argv)
        assert shown.returncode == 0, shown.stderr
        header, *rows = shown.stdout.splitlines()
        assert header.split()[:3] == ["NAME", "ARCH", "WEIGHTS"]
        assert [r.split()[0] for r in rows] == sorted(BUILTIN_MODEL_NAMES)


def test_dry_run_runs_the_services_checks_and_creates_nothing(live, api):
    before = len(api.get("/v1/jobs", params={"limit": 100}).json()["data"])
    bad_model = tandem(live, "submit", str(EXAMPLES / "grpo_tiny.yaml"), "--model", "tiny-qwen3", "--dry-run")
    assert bad_model.returncode == 2
    assert bad_model.stderr.startswith("tandem: error: model.builtin: unknown built-in model 'tiny-qwen3'")
    real = tandem(live, "submit", str(EXAMPLES / "grpo_tiny.yaml"), "--model", "tiny-qwen3")
    assert real.returncode == 2 and real.stderr == bad_model.stderr  # the same check, the same words
    too_big = tandem(live, "submit", "--dry-run", "--set", "resources.workers=500")
    assert too_big.returncode == 2 and "resources.workers" in too_big.stderr
    good = tandem(live, "submit", str(EXAMPLES / "grpo_tiny.yaml"), "--steps", "7", "--dry-run")
    assert good.returncode == 0, good.stderr
    assert json.loads(good.stdout)["trainer"]["total_steps"] == 7
    assert len(api.get("/v1/jobs", params={"limit": 100}).json()["data"]) == before


def test_a_mistyped_flag_shows_that_subcommands_usage(live, finished):
    job_id, _ = finished
    typo = tandem(live, "metrics", job_id, "--lsat", "2")
    assert typo.returncode == 2
    assert typo.stderr.startswith("usage: tandem metrics ")
    assert "tandem metrics: error: unrecognized arguments: --lsat 2" in typo.stderr
    # no abbreviations: `--step` is not `--steps`
    short = tandem(live, "submit", str(EXAMPLES / "grpo_tiny.yaml"), "--step", "3", "--dry-run")
    assert short.returncode == 2 and short.stderr.startswith("usage: tandem submit ")
    assert "unrecognized arguments: --step" in short.stderr


def test_job_ids_by_unique_prefix(live, api, finished):
    job_id, _ = finished
    other = api.post("/v1/jobs", json=tiny_job(trainer={"total_steps": 1})).json()["id"]
    api.post(f"/v1/jobs/{other}/cancel")  # while queued: only its id is needed, and a cancelled job is listed
    bare = job_id.removeprefix("job-")
    for given in (job_id, job_id[:-3], bare[:9], bare):
        shown = tandem(live, "status", given, "--json")
        assert shown.returncode == 0, shown.stderr
        assert json.loads(shown.stdout)["id"] == job_id
    common = os.path.commonprefix([job_id, other])
    ambiguous = tandem(live, "status", common)
    assert ambiguous.returncode == 2
    assert f"job id prefix '{common}' is ambiguous" in ambiguous.stderr
    assert job_id in ambiguous.stderr and other in ambiguous.stderr
    unknown = tandem(live, "events", "job-zzz")
    assert unknown.returncode == 1 and "no job 'job-zzz'" in unknown.stderr


def test_metrics_last_every_keys(live, finished):
    job_id, _ = finished
    last = tandem(live, "metrics", job_id, "--last", "2")
    assert [r.split()[0] for r in last.stdout.splitlines()[1:]] == ["1", "2"]
    every = tandem(live, "metrics", job_id, "--every", "2", "--keys", "actor/lr,val/accuracy")
    header, *rows = every.stdout.splitlines()
    assert header.split() == ["STEP", "actor/lr", "val/accuracy"]
    assert [r.split()[0] for r in rows] == ["0", "2"]
    one = json.loads(tandem(live, "metrics", job_id, "--last", "1", "--keys", "actor/lr", "--json").stdout)
    assert [(r["step"], set(r["values"])) for r in one] == [(2, {"actor/lr"})]
    bad = tandem(live, "metrics", job_id, "--last", "0")
    assert bad.returncode == 2 and "--last" in bad.stderr


def test_a_job_that_stops_early_says_why(live):
    stopped = tandem(live, "submit", str(EXAMPLES / "grpo_tiny.yaml"), "--steps", "5",
                     "--set", "reward.function=tests.test_trainer:always_right", "--set", "trainer.val_every=1",
                     "--set", "trainer.val_size=4", "--set", "trainer.prompts_per_step=2",
                     "--set", "trainer.stop_at_val_accuracy=0.5", "--set", "checkpoint.every=0", "--follow")  # fmt: skip
    assert stopped.returncode == 0, stopped.stderr
    assert "succeeded, stopped at step 1/5: val accuracy 1.000 reached trainer.stop_at_val_accuracy 0.5" in (
        stopped.stdout
    )
