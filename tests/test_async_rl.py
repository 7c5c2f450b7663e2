"""Asynchronous RL (trainer.mode 'async', controller/async_loop.py): the staleness bound holds on every
trained sample, k = 0 computes what sync computes, pause/resume trains every draw once, and bad
settings are 422s naming the field."""

from __future__ import annotations

import json

import pytest

from controller.async_loop import LaneSource
from controller.sink import JsonlSink
from controller.trainer import StopRequested, Trainer
from schema.job import JobSpec
from tests.test_trainer import job_spec

SPLIT = {"placement": "split", "workers": 1, "rollout": {"workers": 1}}
# Time, throughput, the transfer and the async loop's own bookkeeping differ by design.
NOT_COMPARED = ("timing_s/", "perf/", "weight_sync/", "async/")


@pytest.fixture(autouse=True)
def _home(tmp_path, monkeypatch):
    monkeypatch.setenv("TANDEM_HOME", str(tmp_path / "home"))


def small_spec(**trainer) -> JobSpec:
    return job_spec(
        rollout={"n": 4, "max_new_tokens": 4},
        trainer={"total_steps": 3, "prompts_per_step": 2, "val_every": 0, "samples_per_step": 8, **trainer},
        checkpoint={"every": 0, "export_hf": False},
        resources=SPLIT,
    )


def run_job(spec: JobSpec, workdir) -> JsonlSink:
    sink = JsonlSink(workdir)
    Trainer(spec, workdir, sink, name=workdir.name).run()
    return sink


def samples_of(sink: JsonlSink) -> list[dict]:
    lines = (sink.folder / "samples.jsonl").read_text().splitlines()
    return [row for line in lines for row in json.loads(line)["samples"]]


def assert_within_bound(sink: JsonlSink, k: int, batch: int) -> None:
    """Every trained sample's staleness is <= k: the histogram covers 0..k and counts every sample."""
    for row in sink.history:
        values = row["values"]
        assert values["async/staleness_max"] <= k
        assert sum(values[f"async/staleness_hist/{age}"] for age in range(k + 1)) == batch


def test_k0_async_trains_what_sync_trains(ray_cluster, tmp_path):
    sync = run_job(small_spec(total_steps=2), tmp_path / "sync")
    asynchronous = run_job(
        small_spec(mode="async", max_staleness=0, off_policy_correction="none", total_steps=2),
        tmp_path / "async",
    )
    assert [r["step"] for r in asynchronous.history] == [1, 2]
    assert_within_bound(asynchronous, 0, 8)
    for a, b in zip(sync.history, asynchronous.history, strict=True):
        keys = {k for k in a["values"] if not k.startswith(NOT_COMPARED)}
        assert keys == {k for k in b["values"] if not k.startswith(NOT_COMPARED)}
        for key in keys:
            assert b["values"][key] == pytest.approx(a["values"][key], abs=1e-5, rel=0), key
    for a, b in zip(samples_of(sync), samples_of(asynchronous), strict=True):
        assert (a["tokens"], a["spans"]) == (b["tokens"], b["spans"])
        assert a["reward"] == pytest.approx(b["reward"], abs=1e-6)


# make test-slow; in make test the bound is held by tests/test_external_async.py::
# test_agents_feed_an_async_job_within_its_staleness_bound (and the filter by tests/test_staleness_filter.py),
# an async job's pause and resume by test_a_paused_external_job_resumes_with_the_trainers_weight_versions,
# and the lanes by test_partial_rollouts_continue_with_new_weights_and_keep_each_tokens_version below.
@pytest.mark.slow
def test_async_steps_stay_within_the_staleness_bound_and_survive_pause(ray_cluster, tmp_path):
    """k = 1, two rollout workers each generating draws of their own, the decoupled correction: draws
    are generated while a step trains (so some trained samples are one version old), none older; a
    pause checkpoints, the resumed job regenerates what was in flight, skips what was trained, and
    trains every draw once, the steps once each."""
    spec = small_spec(mode="async", max_staleness=1, total_steps=4, rollout_lanes="per_worker").merged(
        {"resources": {"rollout": {"workers": 2}}}
    )
    sink = JsonlSink(tmp_path)
    trainer = Trainer(spec, tmp_path, sink, name="first")
    assert isinstance(trainer.source, LaneSource)
    assert trainer.spec.algorithm.recompute_old_log_probs  # the decoupled objective's proximal pass
    assert trainer.spec.algorithm.rollout_correction.is_weights == "token"
    progress = sink.progress

    def pause_after_two(step, total, values):
        progress(step, total, values)
        if step == 1:
            trainer.control.set_hyperparameters({"lr": 5e-4})  # reaches the trainer at step 2
        if step == 2:
            trainer.control.request_stop("pause")

    sink.progress = pause_after_two
    with pytest.raises(StopRequested, match="pause"):
        trainer.run()
    state = json.loads((tmp_path / "checkpoints" / "step_00000002" / "trainer_state.json").read_text())
    first_draws = [int(r["values"]["async/draw_index"]) for r in sink.history]
    # The oldest untrained draw (its data position kept) and the later draws already trained.
    assert state["draw_index"] not in first_draws
    assert set(state["trained_draws"]) == {d for d in first_draws if d > state["draw_index"]}

    assert [r["values"]["actor/lr"] for r in sink.history] == pytest.approx([1e-3, 5e-4])

    # A fork of the paused job (the service's: a new job resuming from its checkpoint, an override on
    # top) trains the steps after it from the same data position: no draw the parent trained.
    fork_dir = tmp_path / "fork"
    fork_spec = spec.merged({"checkpoint": {"resume_from": str(tmp_path / "checkpoints" / "step_00000002")},
                             "optim": {"lr": 2e-4}})  # fmt: skip
    fork = run_job(fork_spec, fork_dir)
    assert [r["step"] for r in fork.history] == [3, 4]
    fork_draws = [int(r["values"]["async/draw_index"]) for r in fork.history]
    assert not set(fork_draws) & set(first_draws) and min(fork_draws) >= state["draw_index"]
    assert [r["values"]["actor/lr"] for r in fork.history] == pytest.approx([2e-4, 2e-4])

    again = JsonlSink(tmp_path / "again")
    Trainer(spec, tmp_path, again, name="second").run()
    rows = sink.history + again.history
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    draws = first_draws + [int(r["values"]["async/draw_index"]) for r in again.history]
    # no draw trained twice (two lanes may finish their draws in either order)
    assert len(draws) == len(set(draws)) == 4, draws
    assert_within_bound(sink, 1, 8)
    assert_within_bound(again, 1, 8)
    assert sum(r["values"]["async/staleness_hist/1"] for r in rows) > 0  # it did run ahead
    for row in rows:
        assert row["values"]["rollout_corr/is_weight_mean"] > 0  # the behaviour weight is applied
        # one optimizer step a batch: pi_prox is the update's own first forward, no separate pass
        assert "timing_s/old_log_prob" not in row["values"]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"trainer": {"mode": "async"}}, "trainer.mode"),
        ({"trainer": {"mode": "async", "max_staleness": -1}, "resources": SPLIT}, "trainer.max_staleness"),
        ({"trainer": {"mode": "async", "buffer_size": 3}, "resources": SPLIT}, "trainer.buffer_size"),
        (
            {"trainer": {"mode": "async", "rollout_lanes": "fastest"}, "resources": SPLIT},
            "trainer.rollout_lanes",
        ),
        (
            {
                "trainer": {"mode": "async", "off_policy_correction": "behaviour_ppo"},
                "algorithm": {"rollout_correction": {"is_weights": "token"}},
                "resources": SPLIT,
            },
            "trainer.off_policy_correction",
        ),
    ],
)
def test_bad_async_settings_are_a_422_naming_the_field(unscheduled, body, param):
    with unscheduled.client() as http:
        response = http.post("/v1/jobs", json={"model": {"builtin": "tiny-qwen2"}, **body})
    assert response.status_code == 422, response.text
    assert response.json()["error"]["param"] == param


ENV = {"environment": "builtin:guess_number", "max_turns": 2, "max_response_tokens": 16}
BACKEND_TP2 = {"backend": "sglang", "tensor_parallel_size": 2}  # a tensor-parallel backend (spec only)


def rollout_workers(n: int) -> dict:
    return {"placement": "split", "workers": 1, "rollout": {"workers": n}}


@pytest.mark.parametrize(
    ("rollout", "resources", "trainer", "lanes", "k"),
    [
        (ENV, rollout_workers(3), {}, "per_worker", 2),  # multi-turn: a lane per worker, all running
        (ENV, rollout_workers(1), {}, "per_worker", 1),  # k is at least 1
        (ENV, rollout_workers(8), {}, "per_worker", 4),  # capped at the largest k measured stable
        ({}, rollout_workers(3), {}, "per_worker", 2),  # single-turn too
        ({**ENV, **BACKEND_TP2}, rollout_workers(4), {}, "group", 1),  # tensor-parallel replicas: group
        (ENV, rollout_workers(3), {"max_staleness": 0}, "per_worker", 0),  # explicit settings kept
        (ENV, rollout_workers(3), {"rollout_lanes": "group"}, "group", 1),
        ({}, rollout_workers(3), {"rollout_lanes": "group"}, "group", 1),
    ],
)
def test_auto_lanes_and_staleness_resolve_by_the_rule(rollout, resources, trainer, lanes, k):
    from schema.async_rl import buffer_capacity, resolved_lanes, staleness_bound

    spec = small_spec(mode="async", **trainer).merged({"rollout": rollout, "resources": resources})
    assert spec.trainer.rollout_lanes == trainer.get("rollout_lanes", "auto")
    assert (resolved_lanes(spec), staleness_bound(spec)) == (lanes, k)
    assert buffer_capacity(spec, 8) == (k + 1) * 8  # buffer_size None: (k + 1) steps' worth


# An external job's step is its agents' trajectories: rollout.n and prompts_per_step at their defaults.
EXTERNAL = {
    "rollout": {"source": "external", "n": 8, "external": {"group_size": 2, "trajectories_per_step": 4}},
    "trainer": {"prompts_per_step": 16},
}


def test_auto_lanes_resolve_to_group_for_an_external_source():
    from schema.async_rl import resolved_lanes, staleness_bound

    spec = small_spec(mode="async").merged(EXTERNAL)
    assert (resolved_lanes(spec), staleness_bound(spec)) == ("group", 1)


def test_lanes_validation_names_the_field():
    """auto is valid wherever async is; per_worker with tensor-parallel replicas is not, nor is
    per_worker with an external source (group, the old default, stays accepted there)."""
    from pydantic import ValidationError

    small_spec(mode="async").merged({"rollout": {**ENV, **BACKEND_TP2}, "resources": rollout_workers(2)})
    with pytest.raises(ValidationError, match="trainer.rollout_lanes: per_worker needs rollout.tensor_par"):
        small_spec(mode="async", rollout_lanes="per_worker").merged(
            {"rollout": {**ENV, **BACKEND_TP2}, "resources": rollout_workers(2)}
        )
    with pytest.raises(ValidationError, match="trainer.rollout_lanes: not with rollout.source external"):
        small_spec(mode="async", rollout_lanes="per_worker").merged(EXTERNAL)
    small_spec(mode="async", rollout_lanes="group").merged(EXTERNAL)  # the old default: still a job
    with pytest.raises(ValidationError, match="rollout_lanes"):
        small_spec(mode="async", rollout_lanes="fastest")


def test_the_decoupled_objective_matches_its_formula_computed_per_token():
    """AReaL's decoupled PPO, -min(pi_prox/pi_behav, C) * min(r A, clip(r) A) with r = pi_theta/pi_prox,
    token-mean: the loss the async spec builds, against the formula in plain Python floats."""
    import math
    import random

    import torch

    from controller.step_math import corrected_spec
    from tests.test_losses import batch, run
    from workers.losses.policy import make_policy_loss

    spec = small_spec(mode="async", max_staleness=2)
    cfg = corrected_spec(spec).algorithm.policy_loss_config()
    rng = random.Random(0)
    rows, width, cap, eps = 3, 5, cfg.rollout_correction.is_cap, cfg.clip_ratio_low
    theta = [[-rng.uniform(0.2, 3) for _ in range(width)] for _ in range(rows)]
    prox = [[x + rng.uniform(-0.4, 0.4) for x in row] for row in theta]  # r within the dual clip
    behav = [[x + rng.uniform(-1.5, 1.5) for x in row] for row in prox]  # some weights past the cap
    adv = [[rng.uniform(-2, 2)] * width for _ in range(rows)]
    mask = [[1] * width, [1, 1, 1, 0, 0], [1, 1, 1, 1, 0]]
    total, tokens = 0.0, 0
    for i in range(rows):
        for j in range(width):
            if not mask[i][j]:
                continue
            r, a = math.exp(theta[i][j] - prox[i][j]), adv[i][j]
            weight = min(math.exp(prox[i][j] - behav[i][j]), cap)
            total += -weight * min(r * a, min(max(r, 1 - eps), 1 + eps) * a)
            tokens += 1
    as_tensor = lambda rows_: torch.tensor(rows_, dtype=torch.float64)  # noqa: E731
    mb = batch(
        response_mask=as_tensor(mask),
        old_log_probs=as_tensor(prox),
        rollout_log_probs=as_tensor(behav),
        advantages=as_tensor(adv),
    )
    loss, metrics = run(make_policy_loss(cfg), mb, {"log_probs": as_tensor(theta)})
    assert loss.item() == pytest.approx(total / tokens, abs=1e-12)
    assert metrics["rollout_corr/token_clipped_frac"] > 0  # the cap was exercised


def test_behaviour_ppo_is_ppo_clipped_against_the_behaviour_log_probs_per_token():
    """AReaL's plain-PPO baseline, -min(rho A, clip(rho) A) with rho = pi_theta / pi_behav and PPO's
    dual clip max(., ...) capped at -c A where A < 0, token-mean: the loss and its gradient per token
    from the batch the async trainer builds (behaviour_as_old), against plain Python floats."""
    import math
    import random

    import torch

    from controller.step_math import behaviour_as_old, corrected_spec
    from tests.test_losses import batch, run
    from workers.batch import Batch
    from workers.losses.policy import make_policy_loss

    spec = small_spec(mode="async", max_staleness=3, off_policy_correction="behaviour_ppo")
    cfg = corrected_spec(spec).algorithm.policy_loss_config()
    assert (
        cfg.rollout_correction.is_weights == "off"
        and not corrected_spec(spec).algorithm.recompute_old_log_probs
    )
    rng = random.Random(1)
    rows, width = 3, 5
    low, high, c = cfg.clip_ratio_low, cfg.clip_ratio_high, cfg.clip_ratio_c
    behav = [[-rng.uniform(0.2, 3) for _ in range(width)] for _ in range(rows)]
    theta = [[x + rng.uniform(-1.5, 1.5) for x in row] for row in behav]  # ratios past both clips
    adv = [[rng.uniform(-2, 2)] * width for _ in range(rows)]
    mask = [[1] * width, [1, 1, 1, 0, 0], [1, 1, 1, 1, 0]]
    tokens = sum(map(sum, mask))
    total, grads, clipped = 0.0, [[0.0] * width for _ in range(rows)], 0
    for i in range(rows):
        for j in range(width):
            if not mask[i][j]:
                continue
            rho, a = math.exp(theta[i][j] - behav[i][j]), adv[i][j]
            unclipped, clip_branch = -rho * a, -min(max(rho, 1 - low), 1 + high) * a
            loss = max(unclipped, clip_branch)
            if a < 0 and loss > -c * a:  # the dual clip: constant, no gradient
                loss = -c * a
            elif unclipped >= clip_branch:  # d(-rho A)/d log pi_theta = -rho A
                grads[i][j] = -rho * a / tokens
            clipped += clip_branch > unclipped
            total += loss
    as_tensor = lambda rows_: torch.tensor(rows_, dtype=torch.float64)  # noqa: E731
    source = Batch(batch(response_mask=as_tensor(mask), rollout_log_probs=as_tensor(behav),
                         advantages=as_tensor(adv)))  # fmt: skip
    mb = behaviour_as_old(source).tensors
    assert "rollout_log_probs" not in mb.keys() and "rollout_log_probs" in source.tensors.keys()
    log_probs = as_tensor(theta).requires_grad_(True)
    loss, metrics = run(make_policy_loss(cfg), mb, {"log_probs": log_probs})
    loss.backward()
    assert loss.item() == pytest.approx(total / tokens, abs=1e-12)
    assert 0 < clipped < tokens  # both branches were exercised
    assert metrics["actor/pg_clipfrac"] == pytest.approx(clipped / tokens)
    assert torch.allclose(log_probs.grad, as_tensor(grads), atol=1e-12)
    worst = max(abs(theta[i][j] - behav[i][j]) for i in range(rows) for j in range(width) if mask[i][j])
    assert metrics["actor/log_ratio_max"] == pytest.approx(worst, abs=1e-12)
    assert not any(key.startswith(("rollout/", "rollout_corr/")) for key in metrics)  # no self-mismatch


@pytest.mark.slow
def test_behaviour_ppo_trains_against_the_behaviour_log_probs_without_a_proximal_pass(ray_cluster, tmp_path):
    """Two mini-batches a step (where the other corrections run the proximal pass): behaviour_ppo runs
    none, the loss sees no rollout_log_probs (no mismatch report, no weight), and its ratio
    pi_theta / pi_behav moves away from 1 (stale samples, or a second optimizer step)."""
    spec = small_spec(mode="async", max_staleness=1, off_policy_correction="behaviour_ppo").merged(
        {"algorithm": {"ppo_mini_batch_size": 4}}
    )
    sink = run_job(spec, tmp_path)
    assert_within_bound(sink, 1, 8)
    for row in sink.history:
        values = row["values"]
        assert values["actor/optimizer_steps"] == 2
        assert "timing_s/old_log_prob" not in values
        assert not any(key.startswith(("rollout_corr/", "rollout/log_prob_diff")) for key in values)
    assert max(row["values"]["actor/log_ratio_max"] for row in sink.history) > 0


def test_partial_rollouts_continue_with_new_weights_and_keep_each_tokens_version(ray_cluster, tmp_path):
    """Segments of one token and a buffer of one batch: draw 2 starts when step 1 takes draw 1 and
    is generated while step 1 trains, so the sync after step 1 lands in the middle of it and its
    responses go on with version 1 (trained at step 2); a response's staleness is its oldest token's,
    within k, and the decoupled loss trains on them."""
    spec = small_spec(
        mode="async", max_staleness=1, partial_rollouts=True, segment_tokens=1, buffer_size=8, total_steps=2
    ).merged({"rollout": {"max_new_tokens": 48}})
    sink = run_job(spec, tmp_path)
    rows = [r["values"] for r in sink.history]
    assert len(rows) == 2
    assert sum(r.get("async/multi_version_samples", 0.0) for r in rows) > 0
    assert_within_bound(sink, 1, 8)
    for values in rows:
        assert values["rollout_corr/is_weight_mean"] > 0 and abs(values["actor/pg_loss"]) < 1e3
