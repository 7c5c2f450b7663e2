"""An async job (trainer.mode async, split placement) fed by agents through its OpenAI-compatible
endpoint: a new trajectory is an admission to the rollout buffer (a 429 with Retry-After when the
staleness bound says no), complete groups train with staleness <= max_staleness, and the weights of
each step reach the endpoint's engine before the next step's calls (real service, Ray, SQLite)."""

from __future__ import annotations

import time

import pytest

from controller.external_store import Segment, TrajectoryError, TrajectoryStore
from examples import agent_openai
from schema.external import ExternalSpec
from tests.api_util import TERMINAL, tiny_job, wait_for, wait_for_step
from tests.test_openai_endpoint import client, submit_external, wait_for_endpoint

GROUP, PER_STEP, STEPS = 2, 4, 3
SPLIT = {"placement": "split", "workers": 1, "rollout": {"workers": 1}}


@pytest.fixture(scope="module")
def job(live, api):
    spec = tiny_job(
        model={"builtin": "tiny-qwen2-chat"},
        resources=SPLIT,
        rollout={"source": "external", "external": {"group_size": GROUP, "trajectories_per_step": PER_STEP,
                                                     "max_pending": 64}, "free_cache_after_generate": False},
        trainer={"mode": "async", "max_staleness": 0, "total_steps": STEPS, "val_every": 0, "samples_per_step": 8},
        checkpoint={"every": 0},
    )  # fmt: skip
    job_id = submit_external(api, spec)
    yield job_id
    api.post(f"/v1/jobs/{job_id}/cancel")


def first_call(api, job_id: str, tid: str):
    """A trajectory's first call; a 503 (the endpoint not attached to the rollout workers yet) is retried."""
    body = {"model": job_id, "messages": [{"role": "user", "content": f"{tid}: 2+2="}], "max_tokens": 4}
    deadline = time.time() + 120
    while True:
        got = api.post(f"/v1/jobs/{job_id}/openai/trajectories/{tid}/v1/chat/completions", json=body)
        if got.status_code != 503 or time.time() > deadline:
            return got
        time.sleep(0.5)


def reward(api, job_id: str, tid: str, value: float, task: str) -> None:
    got = api.post(f"/v1/jobs/{job_id}/trajectories/{tid}/reward", json={"reward": value, "task_id": task})
    assert got.status_code == 200, got.text


def step_row(api, job_id: str, step: int) -> dict:
    keys = "async/staleness_max,async/staleness_hist/0,async/dropped_stale_total,rollout/log_prob_diff_max"
    rows = api.get(f"/v1/jobs/{job_id}/metrics", params={"keys": keys}).json()["data"]
    return next(r for r in rows if r["step"] == step)["values"]


def trained_ids(api, job_id: str, step: int) -> set[str]:
    samples = api.get(f"/v1/jobs/{job_id}/samples", params={"step": step}).json()["data"]
    return {s["trajectory"]["id"] for s in samples}


@pytest.mark.usefixtures("ray_cluster")
def test_agents_feed_an_async_job_within_its_staleness_bound(live, api, job):
    # k = 0: the buffer admits one step's trajectories per weight version. Four start at version 0...
    for tid in ("a-0", "a-1", "b-0", "b-1"):
        got = first_call(api, job, tid)
        assert got.status_code == 200, got.text
        assert got.json()["tandem"]["weight_version"] == 0
    # ...a fifth is refused before any step trained, with a hint when to retry; it is not stored
    refused = first_call(api, job, "late-0")
    assert refused.status_code == 429, refused.text
    assert int(refused.headers["Retry-After"]) >= 1
    error = refused.json()["error"]
    assert error["code"] == "staleness_bound" and error["param"] == "trajectory_id"
    assert api.get(f"/v1/jobs/{job}/trajectories/late-0").status_code == 404
    # an admitted trajectory's later calls are not new admissions
    again = api.post(f"/v1/jobs/{job}/openai/trajectories/a-0/v1/chat/completions",
                     json={"model": job, "messages": [{"role": "user", "content": "a-0: 2+2="},
                                                      {"role": "assistant", "content": "4"},
                                                      {"role": "user", "content": "sure?"}], "max_tokens": 4})  # fmt: skip
    assert again.status_code == 200, again.text

    for tid, value in (("a-0", 1.0), ("a-1", 0.0), ("b-0", 0.5), ("b-1", 0.0)):
        reward(api, job, tid, value, tid[0])
    assert wait_for_step(api, job, 1, timeout_s=180)["status"] == "running"
    assert trained_ids(api, job, 1) == {"a-0", "a-1", "b-0", "b-1"}

    # step 1's sync widened admission and reached the engine: the refused trajectory starts now, with
    # version 1, and a group of concurrent SDK agents completes step 2 beside it
    for tid in ("late-0", "late-1"):
        got = first_call(api, job, tid)
        assert got.status_code == 200, got.text
        assert got.json()["tandem"]["weight_version"] == 1
        reward(api, job, tid, 0.25, "late")
    agent_openai.main([
        "--url", live.url, "--job", job, "--key", live.token, "--task", "arithmetic", "--reward", "digits",
        "--problems", "1", "--group-size", str(GROUP), "--agents", str(GROUP), "--max-tokens", "6", "--seed", "2",
    ])  # fmt: skip
    wait_for_step(api, job, 2, timeout_s=180)
    ids = trained_ids(api, job, 2)
    assert {"late-0", "late-1"} <= ids and len(ids) == PER_STEP
    # step 3: a group of SDK calls sampled with step 2's weights, and another group of agents
    for tid in ("probe-0", "probe-1"):
        probe = client(live, job, tid).chat.completions.create(
            model=job, messages=[{"role": "user", "content": "1="}], max_tokens=2
        )
        assert probe.tandem["weight_version"] == 2
        reward(api, job, tid, 0.0, "probe")
    agent_openai.main([
        "--url", live.url, "--job", job, "--key", live.token, "--task", "arithmetic", "--reward", "digits",
        "--problems", "1", "--group-size", str(GROUP), "--agents", str(GROUP), "--max-tokens", "6", "--seed", "3",
    ])  # fmt: skip
    final = wait_for(api, job, TERMINAL, timeout_s=180)
    assert final["status"] == "succeeded", final

    for step in range(1, STEPS + 1):
        row = step_row(api, job, step)
        # every trained sample's oldest token came from the weights the step trains at (k = 0)
        assert row["async/staleness_max"] == 0 and row["async/staleness_hist/0"] >= PER_STEP, row
        assert row["async/dropped_stale_total"] == 0
        # the engine served with the trainer's weights: its log-probs are the trainer's
        assert row["rollout/log_prob_diff_max"] <= 1e-4, row


def record_calls(store: TrajectoryStore, tid: str, versions: list[int]) -> None:
    """A trajectory's calls, sampled at `versions` (opened, so admitted, on the first)."""
    seg = Segment(prompt_ids=[1, 2], kind="chat", reason="first call")
    for v in versions:
        seg.add_call([3], [5, 6], [-0.5, -0.25], v)
    store.open(tid).segments.append(seg)


def test_stale_groups_are_dropped_and_counted_by_the_endpoints_buffer():
    """The endpoint's admission and staleness filter alone (controller/external_store.py, no engine):
    k = 1, one group of two per step."""
    store = TrajectoryStore(ExternalSpec(group_size=2, trajectories_per_step=2))
    store.use_buffer(max_staleness=1, capacity=8, version=0)

    called = lambda tid, versions: record_calls(store, tid, versions)  # noqa: E731

    # (k + v + 1) x B = 4 trajectories may start at version 0; the fifth is a 429 with a hint
    for tid, versions in [("x-0", [0]), ("x-1", [1]), ("y-0", [1, 0]), ("y-1", [1])]:
        called(tid, versions)
    with pytest.raises(TrajectoryError) as refused:
        store.open("z-0")
    assert refused.value.status == 429 and refused.value.retry_after > 0
    assert "z-0" not in store.trajectories
    for tid in ("x-0", "x-1", "y-0", "y-1"):
        store.reward(tid, 1.0, tid[0], None, {})  # a group complete: into the buffer
    assert [(g.samples, g.version) for g in store.buffer._items] == [(2, 0), (2, 0)]

    # step 2 trains at version 1: group x (oldest call: version 0) is young enough; each row carries
    # its own trajectory's oldest version
    got = store.take_step(1, "test")
    assert {r.trajectory_id: r.policy_version for r in got["rows"]} == {"x-0": 0, "x-1": 1}
    assert got["dropped_total"] == 0
    # step 3 trains at version 2: group y's oldest call (version 0, its second) is too old: dropped,
    # counted, and its room goes back to admission (AReaL's rule: dropped samples leave `accepted`)
    assert store.take_step(2, "test") is None
    assert store.buffer.dropped == 2
    called("z-0", [1])
    assert store.buffer.running == 1
    # a trajectory dropped for want of a reward gives its room back
    store._swept = 0.0
    assert store.sweep(now=store.trajectories["z-0"].last_call + 1e6) == 1
    assert store.buffer.running == 0


def test_a_restart_from_a_checkpoint_drops_what_the_lost_attempts_weights_sampled():
    """TrajectoryStore.rewind, what `attach` does when the workers restart from a checkpoint older than
    the weights they served (no engine): k = 1, one group of two per step, restarted from step 2."""
    store = TrajectoryStore(ExternalSpec(group_size=2, trajectories_per_step=2))
    store.use_buffer(max_staleness=1, capacity=8, version=2)

    store.buffer.set_version(3)  # the lost attempt trained step 3, and its weights served calls
    for tid, versions in [
        ("x-0", [2]),
        ("x-1", [2]),
        ("y-0", [2, 3]),
        ("y-1", [2]),
        ("z-0", [3]),
        ("w-0", [2]),
    ]:
        record_calls(store, tid, versions)
    for tid in ("x-0", "x-1", "y-0", "y-1"):
        store.reward(tid, 1.0, tid[0], None, {})
    assert store.buffer.running == 2  # z-0 and w-0: open
    # group y (one call at version 3) and the open z-0 are dropped; x and w-0 were sampled by step 2's
    # weights, which the restarted workers hold again
    assert store.rewind(2) == 3
    assert store.buffer.version == 2 and store.buffer.dropped == 2 and store.buffer.running == 1
    assert store.trajectories["z-0"].state == "dropped"
    with pytest.raises(TrajectoryError) as late:
        store.reward("z-0", 1.0, "z", None, {})
    assert late.value.status == 409
    got = store.take_step(2, "test")
    assert {r.trajectory_id for r in got["rows"]} == {"x-0", "x-1"} and got["dropped_total"] == 2
    assert store.take_step(2, "test") is None  # y is gone


@pytest.mark.parametrize("field,value", [("partial_rollouts", True), ("rollout_lanes", "per_worker")])
def test_generated_rollouts_options_are_refused_with_an_external_source(field, value):
    from pydantic import ValidationError

    from schema.job import JobSpec

    spec = tiny_job(
        model={"builtin": "tiny-qwen2-chat"},
        resources=SPLIT,
        rollout={"source": "external", "external": {"group_size": GROUP, "trajectories_per_step": PER_STEP}},
        trainer={"mode": "async", "total_steps": 1},
    )
    JobSpec.model_validate(spec)  # async + external is a job
    with pytest.raises(ValidationError, match=f"trainer.{field}: not with rollout.source external"):
        JobSpec.model_validate({**spec, "trainer": {**spec["trainer"], field: value}})


def answered(api, path: str, body: dict):
    """A POST retried while the endpoint is 503 (a resumed job's new endpoint actor coming up)."""
    deadline = time.time() + 120
    while (got := api.post(path, json=body)).status_code == 503 and time.time() < deadline:
        time.sleep(0.5)
    return got


@pytest.mark.usefixtures("ray_cluster")
@pytest.mark.parametrize("mode", ["async", pytest.param("sync", marks=pytest.mark.slow)])
def test_a_paused_external_job_resumes_with_the_trainers_weight_versions(live, api, mode):
    """One group of two per step (async: k = 0); paused after step 1, resumed from its checkpoint. The
    resumed rollout workers' engine counts its syncs from 0 again: the endpoint must record the
    trainer's version (1), else (async) step 2's group is dropped as stale and the job stalls."""
    trainer = {"mode": mode, "total_steps": 2, "val_every": 0}
    if mode == "async":
        trainer.update(max_staleness=0, samples_per_step=8)
    spec = tiny_job(
        model={"builtin": "tiny-qwen2-chat"},
        resources=SPLIT,
        rollout={"source": "external", "external": {"group_size": GROUP, "trajectories_per_step": GROUP},
                 "free_cache_after_generate": False},
        trainer=trainer,
        checkpoint={"every": 0},
    )  # fmt: skip
    created = api.post("/v1/jobs", json=spec)
    assert created.status_code == 201, created.text
    job = created.json()["id"]
    try:
        wait_for_endpoint(api, job)
        for tid in ("s1-0", "s1-1"):
            got = first_call(api, job, tid)
            assert got.status_code == 200 and got.json()["tandem"]["weight_version"] == 0, got.text
            reward(api, job, tid, float(tid.endswith("0")), "s1")
        assert wait_for_step(api, job, 1)["status"] == "running"
        # an agent's trajectory still open when the job pauses
        opened = first_call(api, job, "open-0")
        assert opened.status_code == 200 and opened.json()["tandem"]["weight_version"] == 1, opened.text
        assert api.post(f"/v1/jobs/{job}/pause").status_code == 200
        assert wait_for(api, job, ("paused",))["step"] == 1
        late = {"reward": 1.0, "task_id": "open"}
        while_paused = api.post(f"/v1/jobs/{job}/trajectories/open-0/reward", json=late)
        assert while_paused.status_code == 409 and "paused" in while_paused.json()["error"]["message"]

        assert api.post(f"/v1/jobs/{job}/resume").status_code == 200
        wait_for_endpoint(api, job)
        # the open trajectory went with the paused job's processes: its reward is refused, saying why
        after = answered(api, f"/v1/jobs/{job}/trajectories/open-0/reward", late)
        assert after.status_code == 404, after.text
        assert "paused or restarted" in after.json()["error"]["message"]
        # new calls record the resumed trainer's version (the checkpoint's step), and step 2 trains them
        for tid in ("s2-0", "s2-1"):
            got = first_call(api, job, tid)
            assert got.status_code == 200 and got.json()["tandem"]["weight_version"] == 1, got.text
            reward(api, job, tid, float(tid.endswith("0")), "s2")
        final = wait_for(api, job, TERMINAL)
        assert final["status"] == "succeeded", final
        assert trained_ids(api, job, 2) == {"s2-0", "s2-1"}
        for step in (1, 2):
            row = step_row(api, job, step)
            if mode == "async":
                assert row["async/staleness_max"] == 0 and row["async/staleness_hist/0"] == GROUP, row
                assert row["async/dropped_stale_total"] == 0, row
            assert row["rollout/log_prob_diff_max"] <= 1e-4, (
                row
            )  # the engine sampled with the trainer's weights
    finally:
        api.post(f"/v1/jobs/{job}/cancel")
