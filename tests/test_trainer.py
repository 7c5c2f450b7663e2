"""The RL loop end to end on a real local Ray with the tiny arithmetic task: GRPO and PPO run,
metrics are finite, weights change and the rollout version advances; a resumed job reproduces
the next step exactly; hyper-parameter edits and stop requests act at step boundaries."""

from __future__ import annotations

import json
import math
import zlib

import pytest
import torch
from safetensors.torch import load_file

from controller.sink import JsonlSink
from controller.trainer import StopRequested, Trainer
from schema.job import JobSpec
from workers.batch import sampling_of

# Metrics that measure time, or count syncs since the process started, legitimately differ on resume.
NONDETERMINISTIC = (
    "timing_s/",
    "perf/throughput",
    "weight_sync/seconds",
    "weight_sync/gbps",
    "weight_sync/version",
)


def job_spec(method: str = "grpo", **overrides) -> JobSpec:
    base = {
        "method": method,
        "reward": {"function": "tests.reward_fns:digit_reward"},
        "model": {"builtin": "tiny-qwen2"},
        "trainer": {"total_steps": 3, "prompts_per_step": 4, "val_every": 2, "val_size": 8},
        "rollout": {"n": 4, "max_new_tokens": 4},
        "optim": {"lr": 1e-3},
        "checkpoint": {"every": 2, "keep_last": 2},
    }
    return JobSpec.model_validate(base).merged(overrides)


@pytest.fixture(autouse=True)
def _home(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("TANDEM_HOME", str(tmp_path_factory.getbasetemp() / "home"))


def run(spec: JobSpec, workdir) -> tuple[Trainer, JsonlSink, dict]:
    sink = JsonlSink(workdir)
    trainer = Trainer(spec, workdir, sink, name=workdir.name)
    return trainer, sink, trainer.run()


def comparable(metrics: dict) -> dict:
    return {k: v for k, v in metrics.items() if not k.startswith(NONDETERMINISTIC)}


def digits_or_failure(prompt: str, response: str, ground_truth, extra) -> dict:
    """digit_reward, raising on about a quarter of the responses (by a hash of their text)."""
    if zlib.crc32(response.encode()) % 4 == 0:
        raise ValueError("no score for this one")
    return {"score": sum(ch.isdigit() for ch in response) / max(len(response), 1)}


# Every sample of a step stored, and a reward function that fails on some of them.
GRPO_RUN = {
    "reward": {"function": "tests.test_trainer:digits_or_failure"},
    "trainer": {"samples_per_step": 16},
}


@pytest.fixture(scope="module")
def grpo_run(ray_cluster, tmp_path_factory):
    workdir = tmp_path_factory.mktemp("grpo")
    monkey = pytest.MonkeyPatch()
    monkey.setenv("TANDEM_HOME", str(tmp_path_factory.getbasetemp() / "home"))
    try:
        return (workdir, *run(job_spec(**GRPO_RUN), workdir))
    finally:
        monkey.undo()


def test_grpo_runs_end_to_end(grpo_run):
    workdir, trainer, sink, last = grpo_run
    steps = [r["step"] for r in sink.history]
    assert steps == [0, 1, 2, 3]  # step 0 is the validation before training
    for key in (
        "actor/pg_loss",
        "actor/grad_norm",
        "critic/score/mean",
        "response_length/mean",
        "timing_s/gen",
        "timing_s/update_actor",
        "timing_s/step",
        "perf/throughput",
        "weight_sync/gbps",
        "val/accuracy",
        "rollout/log_prob_diff_mean",
    ):
        assert key in last, key
    assert all(math.isfinite(v) for v in last.values())
    assert [r["values"]["weight_sync/version"] for r in sink.history[1:]] == [1.0, 2.0, 3.0]
    # The rollout engine samples what the trainer scores: same weights, same log-probs.
    assert all(r["values"]["rollout/log_prob_diff_mean"] < 1e-5 for r in sink.history[1:])
    assert "timing_s/old_log_prob" not in last  # one on-policy step: the separate pass is skipped
    for record in sink.history[1:]:  # rows without advantage run forward only: no gradient from them
        values = record["values"]
        assert 0.0 <= values["critic/advantages/zero_rows"] <= 1.0
        if values["critic/advantages/zero_rows"] == 1.0:
            assert values["actor/grad_norm"] == 0.0
    initial = load_file(str(trainer.job.model_path) + "/model.safetensors")
    exported = load_file(str(workdir / "export" / "model.safetensors"))
    assert any(not torch.equal(initial[k], exported[k]) for k in initial)
    kinds = [e["kind"] for e in sink.events]
    assert kinds.count("checkpoint") == 2 and "exported" in kinds  # steps 2 and 3 (the end)


def test_rows_whose_reward_failed_are_not_trained_on_nor_scored(grpo_run):
    workdir, _, sink, _ = grpo_run
    stored = [json.loads(line) for line in (workdir / "samples.jsonl").read_text().splitlines()]
    assert [s["step"] for s in stored] == [1, 2, 3]
    for record, step in zip(stored, sink.history[1:], strict=True):
        failed = [s for s in record["samples"] if "no score for this one" in s.get("error", "")]
        scored = [s for s in record["samples"] if "error" not in s]
        assert len(failed) + len(scored) == 16 and len(failed) == step["values"]["reward/errors"]
        assert all(s["tokens"]["trained"] == 0 for s in failed)  # no gradient from their tokens
        assert all(s["tokens"]["trained"] > 0 for s in scored)
        mean = sum(s["reward"] for s in scored) / len(scored)
        assert step["values"]["critic/score/mean"] == pytest.approx(mean, abs=1e-6)
    assert sum(r["values"]["reward/errors"] for r in sink.history[1:]) > 0
    validations = [r["values"] for r in sink.history if "val/reward/errors" in r["values"]]
    assert [v["val/unscored"] for v in validations] == [v["val/reward/errors"] for v in validations]
    assert len(validations) >= 2 and sum(v["val/unscored"] for v in validations) > 0


def test_resumed_job_reproduces_the_next_step(grpo_run, tmp_path):
    workdir, _, sink, _ = grpo_run
    step3 = next(r["values"] for r in sink.history if r["step"] == 3)
    resumed_spec = job_spec(
        **GRPO_RUN, checkpoint={"resume_from": str(workdir / "checkpoints" / "step_00000002")}
    )
    _, resumed_sink, last = run(resumed_spec, tmp_path / "resumed")
    assert [r["step"] for r in resumed_sink.history] == [3]
    assert "resumed" in [e["kind"] for e in resumed_sink.events]
    assert comparable(last) == comparable(step3)


def test_ppo_with_a_critic_runs(ray_cluster, tmp_path):
    spec = job_spec("ppo", trainer={"total_steps": 2, "val_every": 0}, checkpoint={"every": 0})
    _, sink, last = run(spec, tmp_path)
    for key in (
        "critic/vf_loss",
        "critic/vf_clipfrac",
        "critic/vpred_mean",
        "critic/values/mean",
        "actor/pg_loss",
    ):
        assert key in last and math.isfinite(last[key]), key
    assert (tmp_path / "checkpoints" / "step_00000002" / "critic").is_dir()


def test_hyperparameter_edits_and_pause_act_at_step_boundaries(ray_cluster, tmp_path):
    spec = job_spec(trainer={"total_steps": 5, "val_every": 0}, checkpoint={"every": 0})
    sink = JsonlSink(tmp_path)
    trainer = Trainer(spec, tmp_path, sink, name="control")
    original_progress = sink.progress

    def steer(step, total, values):
        original_progress(step, total, values)
        if step == 1:
            trainer.control.set_hyperparameters({"lr": 5e-4, "temperature": 0.7})
        if step == 3:
            trainer.control.request_stop("pause")

    sink.progress = steer
    with pytest.raises(StopRequested, match="pause"):
        trainer.run()
    lrs = [r["values"]["actor/lr"] for r in sink.history]
    assert lrs[0] == pytest.approx(1e-3) and lrs[1] == pytest.approx(5e-4)
    edits = [e for e in sink.events if e["kind"] == "hyperparameters"]
    assert len(edits) == 1 and edits[0]["data"] == {"lr": 5e-4, "temperature": 0.7}
    assert trainer.spec.rollout.temperature == 0.7
    # Paused after step 3 with a checkpoint; a new trainer on the same folder continues at step 4.
    assert [r["step"] for r in sink.history] == [1, 2, 3]
    assert (tmp_path / "checkpoints" / "step_00000003" / "trainer_state.json").exists()
    resumed = Trainer(spec, tmp_path, JsonlSink(tmp_path / "again"), name="control2")
    resumed.run()
    assert resumed.step_index == 5


def test_a_reward_model_scores_the_job(ray_cluster, tmp_path):
    from engines.models.tiny_models import build_tiny_model

    rm = build_tiny_model(tmp_path / "rm", reward=True)
    spec = job_spec(
        reward={"function": None, "model_path": str(rm)},
        trainer={"total_steps": 1, "val_every": 0},
        checkpoint={"every": 0, "export_hf": False},
    )
    _, _, last = run(spec, tmp_path / "job")
    # A random classifier gives every sample a different non-zero score.
    assert last["critic/score/max"] > last["critic/score/min"]
    assert "reward/errors" not in last


def test_skipping_the_old_log_prob_pass_changes_nothing(ray_cluster, tmp_path):
    """One mini-batch, one epoch: old log-probs from the update's own first forward give the same
    weights, loss and rollout correction as a separate forward pass. top_k makes the rollout engine
    sample from a renormalised top-k distribution, a real mismatch the token-level TIS corrects."""
    common = {
        "trainer": {"total_steps": 1, "val_every": 0},
        "checkpoint": {"every": 0},
        "rollout": {"top_k": 3},
    }
    tis = {"rollout_correction": {"is_weights": "token"}}
    _, _, skipped = run(job_spec(**common, algorithm=tis), tmp_path / "skip")
    _, _, recomputed = run(
        job_spec(**common, algorithm={**tis, "recompute_old_log_probs": True}), tmp_path / "full"
    )
    assert "timing_s/old_log_prob" in recomputed and "timing_s/old_log_prob" not in skipped
    # pi_trainer / pi_rollout is the top-k mass, below 1: the weights are active and the same.
    assert recomputed["rollout/kl_rollout_trainer"] > 0.01
    assert recomputed["rollout_corr/is_weight_mean"] < 0.99
    for key in ("rollout/log_prob_diff_mean", "rollout/log_prob_diff_max", "rollout_corr/is_weight_mean"):
        assert skipped[key] == pytest.approx(recomputed[key], abs=1e-5), key
    a = load_file(str(tmp_path / "skip" / "export" / "model.safetensors"))
    b = load_file(str(tmp_path / "full" / "export" / "model.safetensors"))
    # Within 1% of one Adam step (lr 1e-3): the two forwards agree to ~1e-7, which Adam's first
    # update (~lr * sign(g)) can amplify on near-zero gradients.
    assert max(float((a[k] - b[k]).abs().max()) for k in a) <= 1e-5
    assert skipped["actor/pg_loss"] == pytest.approx(recomputed["actor/pg_loss"], abs=1e-6)


def test_unknown_hyperparameter_is_named():
    from controller.hyperparameters import hyperparameter_overrides

    with pytest.raises(KeyError, match="'max_new_tokens' cannot be changed"):
        hyperparameter_overrides({"max_new_tokens": 3})


def test_grpo_learns(ray_cluster, tmp_path):
    """The learning test inside `make test`: GRPO raises a reward the random tiny model rarely earns
    (the share of digits in its answer) from ~0.05 to ~0.5 in 15 steps. The arithmetic task's own
    curve (SFT then GRPO, minutes) is `make run`, recorded in bench/RESULTS.md."""
    spec = job_spec(
        trainer={"total_steps": 15, "prompts_per_step": 4, "val_every": 0},
        rollout={"n": 8, "max_new_tokens": 4},
        optim={"lr": 3e-3},
        checkpoint={"every": 0, "export_hf": False},
    )
    _, sink, _ = run(spec, tmp_path)
    scores = [r["values"]["critic/score/mean"] for r in sink.history]
    first, last = sum(scores[:3]) / 3, sum(scores[-3:]) / 3
    assert last > first + 0.2, scores


def always_right(prompt: str, response: str, ground_truth, extra) -> dict:
    return {"score": 1.0}


def test_a_reached_val_accuracy_target_finishes_the_job_early(ray_cluster, tmp_path):
    spec = job_spec(
        method="sft",
        reward={"function": "tests.test_trainer:always_right"},
        trainer={"total_steps": 6, "val_every": 2, "stop_at_val_accuracy": 0.5},
        checkpoint={"every": 0},
    )
    _, sink, last = run(spec, tmp_path)
    assert [r["step"] for r in sink.history] == [0, 1, 2]
    assert last["val/accuracy"] == 1.0
    assert [e["data"]["step"] for e in sink.events if e["kind"] == "target_reached"] == [2]
    assert (tmp_path / "export" / "config.json").exists()  # finished as at the end: export written


def test_the_in_reward_kl_coefficient_adapts_to_its_target_and_validation_samples_as_asked(
    ray_cluster, tmp_path
):
    """algorithm.kl_reward_coef starts the KL penalty's weight and kl_target adapts it after each step
    of 16 samples, beta *= 1 + clip(KL / target - 1, -0.2, 0.2) * 16 / 10000 (the hand computation
    against each step's logged KL); trainer.val_greedy false samples validation at
    rollout.temperature with seed 0."""
    spec = job_spec(algorithm={"kl_in_reward": True, "kl_reward_coef": 0.05, "kl_target": 0.001},
                    trainer={"val_every": 3, "val_size": 4, "val_greedy": False}, checkpoint={"every": 0})  # fmt: skip
    trainer, sink, _ = run(spec, tmp_path)
    steps = [r["values"] for r in sink.history if r["step"] > 0]
    beta = 0.05
    for values in steps:
        assert values["actor/reward_kl_penalty_coeff"] == pytest.approx(beta, rel=1e-12)
        error = min(max(values["actor/reward_kl_penalty"] / 0.001 - 1.0, -0.2), 0.2)
        beta *= 1.0 + error * 16 / 10_000
    assert len(steps) == 3 and trainer.kl.value == pytest.approx(beta, rel=1e-12) and beta != 0.05
    sampling = sampling_of(trainer.job.val_batch)
    assert (sampling.temperature, sampling.seed) == (spec.rollout.temperature, 0) and sampling.temperature > 0


def test_a_val_accuracy_target_needs_validation():
    with pytest.raises(ValueError, match="stop_at_val_accuracy needs validation"):
        job_spec(trainer={"val_every": 0, "stop_at_val_accuracy": 0.5})


def half_uniform_reward(prompt: str, response: str, ground_truth, extra) -> dict:
    """About half the prompts score every answer 0.5 (a uniform group, no signal); the others score
    each answer by a hash of its text, so their groups differ unless all answers are the same."""
    if zlib.crc32(str(ground_truth).encode()) % 2 == 0:
        return {"score": 0.5}
    return {"score": (zlib.crc32(response.encode()) % 1000) / 1000}


def test_dynamic_sampling_fills_the_batch_and_resumes_exactly(ray_cluster, tmp_path):
    options = {
        "reward": {"function": "tests.test_trainer:half_uniform_reward"},
        "trainer": {"total_steps": 3, "val_every": 0},
        "algorithm": {"dynamic_sampling": {"enabled": True, "max_rounds": 8}},
        "checkpoint": {"every": 2, "export_hf": False},
    }
    trainer, sink, _ = run(job_spec(**options), tmp_path / "full")
    steps = [r["values"] for r in sink.history]
    for values in steps:
        assert values["dynamic_sampling/groups_kept"] == 4 and values["dynamic_sampling/groups_padded"] == 0
        # Every round draws one loader batch (4 prompts); every drawn group is kept or dropped.
        assert values["dynamic_sampling/prompts_drawn"] == 4 * values["dynamic_sampling/rounds"]
        assert values["dynamic_sampling/groups_dropped"] <= values["dynamic_sampling/prompts_drawn"] - 4
    assert sum(v["dynamic_sampling/groups_dropped"] for v in steps) > 0
    # The loader's position counts exactly the prompts drawn (the task has far more rows than that).
    drawn = sum(v["dynamic_sampling/prompts_drawn"] for v in steps)
    state = trainer.job.loader.state_dict()
    assert (state["epoch"], state["position"]) == (0, drawn)
    # Resumed from step 2, the job draws the prompts and samples the uninterrupted one did at step 3.
    resumed_spec = job_spec(**options).merged(
        {"checkpoint": {"resume_from": str(tmp_path / "full" / "checkpoints" / "step_00000002")}}
    )
    resumed, resumed_sink, last = run(resumed_spec, tmp_path / "resumed")
    assert [r["step"] for r in resumed_sink.history] == [3]
    assert comparable(last) == comparable(steps[-1])
    assert resumed.job.loader.state_dict() == trainer.job.loader.state_dict()


def test_overlong_responses_are_masked_and_penalised(ray_cluster, tmp_path):
    """A budget of 2 new tokens: the random tiny model rarely stops that early."""
    spec = job_spec(
        trainer={"total_steps": 1, "val_every": 0},
        rollout={"max_new_tokens": 2},
        algorithm={"overlong": {"filter": True, "penalty_buffer": 2, "penalty_factor": 1.0}},
        checkpoint={"every": 0, "export_hf": False},
    )
    _, _, last = run(spec, tmp_path)
    assert last["overlong/truncated_frac"] > 0.5
    assert last["overlong/masked_frac"] == last["overlong/truncated_frac"]
    # Budget 2, buffer 2: a response of L tokens loses L / 2.
    assert last["overlong/penalty_mean"] == pytest.approx(-last["response_length/mean"] / 2, abs=1e-6)
    assert last["critic/score/min"] <= 0.0  # a digit share <= 1, minus the full penalty of 1


def test_rollout_rejection_runs_the_old_log_prob_pass_and_takes_tokens_out_of_the_loss(ray_cluster, tmp_path):
    """top_k 3 on a near-uniform tiny model: pi_trainer / pi_rollout is the top-3 mass, far below the
    band's 0.5, so every token is rejected and the update has nothing left to learn from."""
    spec = job_spec(
        trainer={"total_steps": 1, "val_every": 0},
        rollout={"top_k": 3},
        algorithm={"rollout_correction": {"rejection": "token", "rejection_low": 0.5}},
        checkpoint={"every": 0, "export_hf": False},
    )
    _, _, last = run(spec, tmp_path)
    assert "timing_s/old_log_prob" in last  # rejection needs the trainer's log-probs before the update
    assert last["rollout_corr/token_rejected_frac"] == 1.0 and last["rollout_corr/seq_rejected_frac"] == 1.0
    assert last["actor/pg_loss"] == 0.0 and last["actor/grad_norm"] == 0.0
    assert last["rollout/log_prob_diff_mean"] > 1.0  # the mismatch is still reported
