"""Over-long handling and DAPO dynamic sampling on hand-made batches: the soft penalty's values, the
filter's mask, and a sampler that keeps signal-bearing groups, pads when rounds run out and keeps
groups apart by round. The jobs that use them run in tests/test_trainer.py."""

from __future__ import annotations

import pytest
import torch

from controller.batch_source import sample_signal_groups, uniform_groups
from controller.step_math import OVERLONG_KEPT, add_advantages, apply_overlong, overlong_penalty
from engines.training.base import SCORED
from schema.job import JobSpec
from schema.training import OverlongSpec
from workers.batch import Batch


def rollout_batch(lengths: list[int], truncated: list[int], width: int = 4, uids=None) -> Batch:
    """Rows of a 2-token prompt and responses of `lengths` tokens in a response of `width` columns."""
    response_mask = torch.tensor([[1] * n + [0] * (width - n) for n in lengths])
    attention_mask = torch.cat([torch.ones(len(lengths), 2, dtype=torch.long), response_mask], 1)
    uids = uids or [str(i) for i in range(len(lengths))]
    return Batch.from_dict(
        {
            "attention_mask": attention_mask,
            "response_mask": response_mask.clone(),
            "truncated": torch.tensor(truncated),
        },
        {"uid": uids},
    )


def test_soft_overlong_penalty_rises_linearly_over_the_buffer():
    # Budget 8, buffer 4: no penalty up to 4 tokens, then -1/4 per token down to -factor at 8.
    lengths = torch.tensor([0, 4, 5, 6, 8])
    torch.testing.assert_close(overlong_penalty(lengths, 8, 4, 1.0), torch.tensor([0, 0, -0.25, -0.5, -1.0]))
    torch.testing.assert_close(
        overlong_penalty(lengths, 8, 4, 0.5), torch.tensor([0, 0, -0.125, -0.25, -0.5])
    )
    assert not overlong_penalty(lengths, 8, 0, 1.0).any()  # buffer 0: off


def test_overlong_filter_and_penalty_on_a_batch():
    batch = rollout_batch(lengths=[4, 2, 3, 4], truncated=[1, 0, 0, 0])  # row 3 stopped at its last token
    scores = torch.tensor([1.0, 1.0, 0.0, 0.5])
    cfg = OverlongSpec(filter=True, penalty_buffer=2, penalty_factor=1.0)
    out, penalised, metrics = apply_overlong(batch, scores, cfg, max_new_tokens=4)
    torch.testing.assert_close(penalised, torch.tensor([0.0, 1.0, -0.5, -0.5]))
    assert out.tensors[OVERLONG_KEPT].tolist() == [False, True, True, True]  # only the truncated row is out
    assert "overlong_kept" not in batch.tensors.keys()  # the input batch is untouched
    assert metrics == pytest.approx(
        {"overlong/truncated_frac": 0.25, "overlong/masked_frac": 0.25, "overlong/penalty_mean": -2.5 / 4}
    )
    unchanged, same, metrics = apply_overlong(batch, scores, OverlongSpec(), max_new_tokens=4)
    assert torch.equal(unchanged.tensors["response_mask"], batch.tensors["response_mask"])
    assert torch.equal(same, scores) and metrics == {"overlong/truncated_frac": 0.25}


def test_a_filtered_row_leaves_the_loss_but_its_penalised_score_stays_in_its_groups_baseline():
    """GRPO over one group of 4, the first row truncated: its penalised score -1.0 enters the group's mean
    and std (it entered as 0, its response mask cleared before the rewards were placed), and it leaves
    the loss alone."""
    batch = rollout_batch(lengths=[4, 2, 3, 1], truncated=[1, 0, 0, 0], uids=["g"] * 4)
    cfg = OverlongSpec(filter=True, penalty_buffer=2, penalty_factor=1.0)
    out, penalised, _ = apply_overlong(batch, torch.tensor([0.0, 1.0, 0.5, 0.5]), cfg, max_new_tokens=4)
    trained, _ = add_advantages(out, penalised, JobSpec.model_validate({}), kl_coef=0.0)
    s = torch.tensor([-1.0, 1.0, 0.0, 0.5])  # penalties: 4 tokens -1, 3 tokens -0.5
    want = (s - s.mean()) / (s.std() + 1e-6)
    got = trained.tensors["advantages"][:, 0]
    torch.testing.assert_close(got[1:], want[1:], rtol=0, atol=1e-5)
    assert trained.tensors["response_mask"].sum(1).tolist() == [0, 2, 3, 1]


def test_overlong_options_are_checked_against_the_budget():
    with pytest.raises(ValueError, match="penalty_buffer = 9 must not exceed rollout.max_new_tokens = 8"):
        JobSpec.model_validate(
            {"rollout": {"max_new_tokens": 8}, "algorithm": {"overlong": {"penalty_buffer": 9}}}
        )
    with pytest.raises(ValueError, match="dynamic_sampling needs groups"):
        JobSpec.model_validate({"rollout": {"n": 1}, "algorithm": {"dynamic_sampling": {"enabled": True}}})
    with pytest.raises(ValueError, match="max_rounds"):
        JobSpec.model_validate({"algorithm": {"dynamic_sampling": {"max_rounds": 0}}})


# ---- dynamic sampling ---------------------------------------------------------------------------

N = 2  # samples per group


def rounds_of(group_scores: list[list[list[float]]]):
    """A draw function replaying rounds of groups of N scores; each group's uid is its prompt id."""
    calls = []

    def draw(round_index: int):
        calls.append(round_index)
        groups = group_scores[round_index]
        scores = torch.tensor([float(s) for g in groups for s in g])
        uids = [f"p{round_index}{g}" for g in range(len(groups)) for _ in range(N)]
        batch = rollout_batch([1] * len(scores), [0] * len(scores), uids=uids)
        batch.tensors["scores"] = scores
        return batch, scores, {"reward/mean": float(scores.mean())}

    return draw, calls


def test_uniform_groups():
    assert uniform_groups(torch.tensor([1.0, 1.0, 0.0, 1.0, 0.5, 0.5]), 2).tolist() == [True, False, True]


def test_dynamic_sampling_fills_the_batch_with_signal_bearing_groups():
    # Round 0: one signal group of three; round 1: two more, of which only one is needed.
    draw, calls = rounds_of(
        [
            [[1, 1], [0, 1], [0, 0]],
            [[0.5, 0.5], [0.2, 0.8], [0.1, 0.9]],
        ]
    )
    batch, scores, metrics = sample_signal_groups(draw, groups_wanted=2, n=N, max_rounds=5)
    assert calls == [0, 1]  # stops as soon as the batch is full
    assert scores.tolist() == pytest.approx([0.0, 1.0, 0.2, 0.8])
    assert torch.equal(batch.tensors["scores"], scores)  # rows and scores stay aligned
    assert list(batch.non_tensors["uid"]) == ["p01/0", "p01/0", "p11/1", "p11/1"]
    assert metrics == pytest.approx(
        {
            "reward/mean": (0.5 + 0.5) / 2,
            "dynamic_sampling/prompts_drawn": 6.0,
            "dynamic_sampling/groups_dropped": 3.0,
            "dynamic_sampling/rounds": 2.0,
            "dynamic_sampling/groups_kept": 2.0,
            "dynamic_sampling/groups_padded": 0.0,
        }
    )


def test_dynamic_sampling_pads_with_dropped_groups_when_rounds_run_out():
    draw, calls = rounds_of([[[1, 1], [0, 1]], [[0, 0], [1, 1]]])
    batch, scores, metrics = sample_signal_groups(draw, groups_wanted=2, n=N, max_rounds=2)
    assert calls == [0, 1]
    assert scores.tolist() == [0.0, 1.0, 1.0, 1.0]  # the signal group, then the first dropped one
    assert list(batch.non_tensors["uid"]) == ["p01/0", "p01/0", "p00/0", "p00/0"]
    assert metrics["dynamic_sampling/groups_padded"] == 1.0
    assert metrics["dynamic_sampling/groups_dropped"] == 3.0


def test_a_prompt_drawn_twice_in_one_step_stays_two_groups():
    def draw(round_index: int):  # the same prompt "7" in both rounds (an epoch rolled over)
        scores = torch.tensor([0.0, 1.0])
        return rollout_batch([1, 1], [0, 0], uids=["7", "7"]), scores, {}

    batch, _, _ = sample_signal_groups(draw, groups_wanted=2, n=N, max_rounds=2)
    assert list(batch.non_tensors["uid"]) == ["7/0", "7/0", "7/1", "7/1"]


def test_the_dapo_example_is_a_valid_spec_with_the_options_on():
    import yaml

    from tests.conftest import REPO

    spec = JobSpec.model_validate(yaml.safe_load((REPO / "examples" / "dapo_tiny.yaml").read_text()))
    a = spec.algorithm
    assert a.dynamic_sampling.enabled and a.overlong.penalty_buffer == 2 and a.overlong.penalty_factor == 0.5
    assert spec.rollout.max_new_tokens == 6  # the buffer is the last 2 of 6 new tokens
    assert a.rollout_correction.is_weights == "token"


def test_every_new_algorithm_option_is_described_in_the_schema():
    """The REST payload is JobSpec, so these descriptions are what the API's OpenAPI schema shows."""
    defs = JobSpec.model_json_schema()["$defs"]
    algorithm = defs["AlgorithmSpec"]["properties"]
    for section, model in (
        ("rollout_correction", "RolloutCorrectionConfig"),
        ("overlong", "OverlongSpec"),
        ("dynamic_sampling", "DynamicSamplingSpec"),
    ):
        assert algorithm[section].get("description"), section
        for name, field in defs[model]["properties"].items():
            assert field.get("description"), f"{section}.{name}"


# ---- multi-turn trajectories: the budget is the trajectory's own --------------------------------


def multiturn_spec(**overlong) -> JobSpec:
    return JobSpec.model_validate(
        {
            "model": {"builtin": "tiny-qwen2-chat"},
            "data": {"builtin_task": "guess_number"},
            "rollout": {
                "environment": "builtin:guess_number",
                "max_new_tokens": 6,
                "max_response_tokens": 40,
            },
            "algorithm": {"overlong": overlong},
        }
    )


def test_a_trajectory_is_penalised_against_its_response_token_budget_not_max_new_tokens():
    """Three trajectories of 12, 34 and 40 tokens after their prompt (sampled turns and observations
    alike), budget 40, buffer 10: lengths up to 30 go free, then -1/10 per token. Measured against
    max_new_tokens = 6, every one of them would have been far past its budget."""
    from workers.multiturn import Trajectory, trajectory_tensors

    spec = multiturn_spec(penalty_buffer=10, penalty_factor=1.0, filter=True)
    assert (spec.rollout.response_budget_field, spec.rollout.response_budget) == ("max_response_tokens", 40)
    trajectories = []
    for n, finish in ((12, "done"), (34, "max_turns"), (40, "budget")):
        traj = Trajectory(env=None, prompt_ids=[5, 6, 7], finish_reason=finish, reward=1.0)
        traj.append([1] * (n // 2), sampled=True, log_probs=[-1.0] * (n // 2))
        traj.append([2] * (n - n // 2), sampled=False)  # observations count towards the budget
        trajectories.append(traj)
    batch = Batch(trajectory_tensors(trajectories, prompt_width=4, response_width=40, pad=0))
    out, penalised, metrics = apply_overlong(
        batch, batch.tensors["env_rewards"], spec.algorithm.overlong, spec.rollout.response_budget
    )
    torch.testing.assert_close(penalised, torch.tensor([1.0, 1.0 - 0.4, 1.0 - 1.0]))
    assert out.tensors[OVERLONG_KEPT].tolist() == [True, False, False]  # truncated by turns or budget
    assert metrics == pytest.approx(
        {"overlong/truncated_frac": 2 / 3, "overlong/masked_frac": 2 / 3, "overlong/penalty_mean": -1.4 / 3}
    )


def test_the_penalty_buffer_of_a_multiturn_job_is_checked_against_its_trajectory_budget():
    assert multiturn_spec(penalty_buffer=40).algorithm.overlong.penalty_buffer == 40  # > max_new_tokens 6
    with pytest.raises(
        ValueError, match="penalty_buffer = 41 must not exceed rollout.max_response_tokens = 40"
    ):
        multiturn_spec(penalty_buffer=41)
    single = JobSpec.model_validate({"rollout": {"max_new_tokens": 8}})
    assert (single.rollout.response_budget_field, single.rollout.response_budget) == ("max_new_tokens", 8)


def test_a_group_with_fewer_than_two_scored_rows_or_equal_scored_rows_has_no_signal():
    """A failed reward's 0.0 placeholder (SCORED False) is no score: [1, failed] has one scored row,
    [0.5, 0.5, failed] is uniform over the rows that scored, [1, 0] has signal."""
    threes = torch.tensor([0.5, 0.5, 0.0, 1.0, 0.0, 1.0])
    scored_threes = torch.tensor([True, True, False, True, False, True])
    assert uniform_groups(threes, 3, scored_threes).tolist() == [True, True]
    scores = torch.tensor([1.0, 0.0, 0.5, 0.5, 0.0, 0.0, 1.0, 0.0])
    scored = torch.tensor([True, False, True, True, False, False, True, True])
    assert uniform_groups(scores, 2, scored).tolist() == [True, True, True, False]

    def draw(round_index: int):
        batch = rollout_batch([1] * 8, [0] * 8, uids=[f"p{i // 2}" for i in range(8)])
        batch.tensors[SCORED] = scored
        return batch, scores, {}

    batch, kept, metrics = sample_signal_groups(draw, groups_wanted=1, n=N, max_rounds=1)
    assert kept.tolist() == [1.0, 0.0] and list(batch.non_tensors["uid"]) == ["p3/0", "p3/0"]
    assert metrics["dynamic_sampling/groups_dropped"] == 3.0


def failed_environment_batch() -> Batch:
    """Trajectories of two prompts, each two sampled tokens and an observation token: a = done 1.0, the
    environment raised, max_turns 0.5, budget 0.0; b = the environment hung, done 1.0. A failed one's
    reward is `fail`'s 0.0, whatever it had gathered before."""
    from workers.multiturn import Trajectory, trajectory_non_tensors, trajectory_tensors

    ends = [("done", 1.0), ("env_error", None), ("max_turns", 0.5), ("budget", 0.0), ("env_timeout", None),
            ("done", 1.0)]  # fmt: skip
    trajectories = []
    for finish, reward in ends:
        traj = Trajectory(env=None, prompt_ids=[5, 6], reward=0.7)
        traj.append([1, 2], sampled=True, log_probs=[-1.0, -1.0])
        traj.append([3], sampled=False)
        if reward is None:
            traj.fail(finish, "the environment broke")
        else:
            traj.finish_reason, traj.reward = finish, reward
        trajectories.append(traj)
    tensors = trajectory_tensors(trajectories, prompt_width=2, response_width=4, pad=0)
    return Batch(tensors, {**trajectory_non_tensors(trajectories), "uid": list("aaaabb")})


def test_a_trajectory_its_environment_failed_is_not_scored_but_truncated_ones_are():
    """GRPO: prompt a's scored rows [1, 0.5, 0] have mean 0.5 and unbiased std 0.5, so advantages
    [1, 0, -1]; the failure gets none and stays out of the mean. Prompt b has one scored row: 0. The
    failures leave the loss and its sequence count; the score means are over the 4 that scored."""
    from controller.step_math import batch_metrics, validation_metrics
    from controller.trajectory_view import multiturn_metrics
    from engines.training.base import GlobalCounts

    batch = failed_environment_batch()
    assert batch.tensors[SCORED].tolist() == [True, False, True, True, False, True]
    scores = batch.tensors["env_rewards"]
    out, _ = add_advantages(batch, scores, JobSpec.model_validate({}), kl_coef=0.0)
    want = torch.tensor([1.0, 0.0, 0.0, -1.0, 0.0, 0.0])
    torch.testing.assert_close(out.tensors["advantages"][:, 0], want, rtol=0, atol=1e-5)
    assert out.tensors["response_mask"].sum(1).tolist() == [2, 0, 2, 2, 0, 2]
    assert GlobalCounts.of([out.tensors]).sequences == 4
    metrics = {**multiturn_metrics(batch), **batch_metrics(out, scores, max_new_tokens=4)}
    assert metrics["multiturn/env_errors"] == 1 and metrics["multiturn/env_timeouts"] == 1
    assert metrics["multiturn/reward/mean"] == metrics["critic/score/mean"] == pytest.approx(2.5 / 4)
    assert validation_metrics(batch, scores) == pytest.approx(
        {"val/score/mean": 2.5 / 4, "val/accuracy": 2 / 4, "val/unscored": 2.0}
    )
