"""Advantage estimators and KL-in-reward helpers against hand-computed values and naive loops."""

from __future__ import annotations

import math
import statistics

import numpy as np
import pytest
import torch

from controller.advantages import (
    ADVANTAGE_ESTIMATORS,
    KLController,
    apply_kl_penalty,
    compute_advantages,
    compute_gae,
    compute_grpo,
    compute_reinforce_pp,
    compute_reinforce_pp_baseline,
    compute_rloo,
    masked_whiten,
    scores_to_token_rewards,
)
from controller.step_math import add_advantages, batch_metrics
from engines.training.base import SCORED, GlobalCounts
from schema.job import JobSpec
from workers.batch import Batch

D = torch.float64


def t(rows) -> torch.Tensor:
    return torch.tensor(rows, dtype=D)


def naive_gae(rewards: list[float], values: list[float], gamma: float, lam: float) -> list[float]:
    """GAE over a list of valid tokens only, straight from the definition (no recursion trick)."""
    n = len(rewards)
    deltas = [rewards[i] + gamma * (values[i + 1] if i + 1 < n else 0.0) - values[i] for i in range(n)]
    return [sum((gamma * lam) ** (j - i) * deltas[j] for j in range(i, n)) for i in range(n)]


def naive_whiten(flat: list[float]) -> list[float]:
    mean, std = statistics.fmean(flat), statistics.stdev(flat)
    return [(x - mean) / math.sqrt(std**2 + 1e-8) for x in flat]


# ---- GAE -------------------------------------------------------------------------------------------


def test_gae_hand_values():
    # delta = [0.18-0.5, 0.36-0.2, 1-0.4] = [-0.32, 0.16, 0.6]; gamma*lam = 0.72
    adv, ret = compute_gae(t([[0, 0, 1]]), t([[0.5, 0.2, 0.4]]), t([[1, 1, 1]]), 0.9, 0.8, whiten=False)
    torch.testing.assert_close(adv, t([[0.10624, 0.592, 0.6]]))
    torch.testing.assert_close(ret, t([[0.60624, 0.792, 1.0]]))


def test_gae_matches_naive_loop_with_masks():
    g = torch.Generator().manual_seed(0)
    rewards, values = torch.randn(4, 6, generator=g, dtype=D), torch.randn(4, 6, generator=g, dtype=D)
    mask = t([[1, 1, 1, 1, 1, 1], [1, 1, 1, 0, 0, 0], [1, 0, 1, 1, 0, 0], [0, 0, 0, 0, 0, 0]])
    adv, ret = compute_gae(rewards, values, mask, gamma=0.95, lam=0.7, whiten=False)
    for i in range(4):
        idx = [j for j in range(6) if mask[i, j]]
        expected = naive_gae(
            [rewards[i, j].item() for j in idx], [values[i, j].item() for j in idx], 0.95, 0.7
        )
        for k, j in enumerate(idx):
            assert adv[i, j].item() == pytest.approx(expected[k], abs=1e-12)
            assert ret[i, j].item() == pytest.approx(expected[k] + values[i, j].item(), abs=1e-12)
    assert (adv[mask == 0] == 0).all() and (ret[mask == 0] == 0).all()


def test_gae_lambda_one_gamma_one_is_reward_to_go_minus_value():
    g = torch.Generator().manual_seed(1)
    rewards, values = torch.randn(3, 5, generator=g, dtype=D), torch.randn(3, 5, generator=g, dtype=D)
    mask = t([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 1, 0, 0, 0]])
    adv, ret = compute_gae(rewards, values, mask, gamma=1.0, lam=1.0, whiten=False)
    to_go = (rewards * mask).flip(-1).cumsum(-1).flip(-1)
    torch.testing.assert_close(adv, (to_go - values) * mask)
    torch.testing.assert_close(ret, to_go * mask)


def test_gae_masked_tail_does_not_leak():
    rewards, values = t([[0.3, -0.1, 1.0]]), t([[0.2, 0.5, -0.4]])
    short = compute_gae(rewards, values, t([[1, 1, 1]]), 0.9, 0.9, whiten=False)
    # The same row padded with a tail of garbage rewards and values that the mask excludes.
    padded = compute_gae(
        torch.cat([rewards, t([[100.0, -50.0]])], 1),
        torch.cat([values, t([[7.0, 9.0]])], 1),
        t([[1, 1, 1, 0, 0]]),
        0.9,
        0.9,
        whiten=False,
    )
    for a, b in zip(short, padded, strict=True):
        torch.testing.assert_close(b[:, :3], a)
        assert (b[:, 3:] == 0).all()


def test_gae_whitening_is_over_valid_tokens():
    g = torch.Generator().manual_seed(2)
    rewards, values = torch.randn(3, 4, generator=g, dtype=D), torch.randn(3, 4, generator=g, dtype=D)
    mask = t([[1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0]])
    raw, _ = compute_gae(rewards, values, mask, 1.0, 0.95, whiten=False)
    white, _ = compute_gae(rewards, values, mask, 1.0, 0.95, whiten=True)
    valid = mask.bool()
    expected = naive_whiten(raw[valid].tolist())
    torch.testing.assert_close(white[valid], t(expected))
    assert (white[~valid] == 0).all()


def test_masked_whiten_ignores_masked_values():
    x, mask = t([[1.0, 2.0, 1e6], [3.0, 1e6, 1e6]]), t([[1, 1, 0], [1, 0, 0]])
    torch.testing.assert_close(masked_whiten(x, mask)[mask.bool()], t(naive_whiten([1.0, 2.0, 3.0])))


# ---- group estimators ------------------------------------------------------------------------------

# groups: a = [1, 0] (mean .5, std sqrt(.5)); b = [2, 2, 5] (mean 3, std sqrt(3)); c = [7] alone
SCORES = t([1, 2, 0, 2, 7, 5])
UIDS = np.array(["a", "b", "a", "b", "c", "b"], dtype=object)
ONES = torch.ones(6, 1, dtype=D)


def test_grpo_hand_values():
    adv = compute_grpo(SCORES, UIDS, ONES, norm_by_std=True, epsilon=0.0)[:, 0]
    r2, r3 = math.sqrt(0.5), math.sqrt(3.0)
    torch.testing.assert_close(adv, t([0.5 / r2, -1 / r3, -0.5 / r2, -1 / r3, 0.0, 2 / r3]))


def test_dr_grpo_is_not_divided_by_std():
    adv = compute_grpo(SCORES, list(UIDS), ONES, norm_by_std=False)[:, 0]
    torch.testing.assert_close(adv, t([0.5, -1, -0.5, -1, 0, 2]))


def test_grpo_sums_to_zero_per_group_and_broadcasts_to_mask():
    g = torch.Generator().manual_seed(3)
    scores = torch.randn(12, generator=g, dtype=D)
    uids = [("p", i % 4) for i in range(12)]  # any hashable works as a group id
    mask = (torch.rand(12, 5, generator=g) > 0.3).to(D)
    for norm in (True, False):
        adv = compute_grpo(scores, uids, mask, norm_by_std=norm)
        seq = compute_grpo(scores, uids, torch.ones(12, 1, dtype=D), norm_by_std=norm)[:, 0]
        torch.testing.assert_close(adv, seq[:, None] * mask)
        for k in range(4):
            assert seq[k::4].sum().item() == pytest.approx(0.0, abs=1e-12)


def test_rloo_hand_values_and_naive_loop():
    adv = compute_rloo(SCORES, UIDS, ONES)[:, 0]
    # b: 2 - (2+5)/2 = -1.5, 5 - (2+2)/2 = 3; a: 1 - 0 = 1, 0 - 1 = -1; c alone: 0
    torch.testing.assert_close(adv, t([1.0, -1.5, -1.0, -1.5, 0.0, 3.0]))
    s, u = SCORES.tolist(), list(UIDS)
    for i in range(6):
        others = [s[j] for j in range(6) if u[j] == u[i] and j != i]
        assert adv[i].item() == pytest.approx(s[i] - statistics.fmean(others) if others else 0.0)


def test_reinforce_pp_hand_values():
    rewards, mask = t([[0, 0, 1], [0, 1, 9]]), t([[1, 1, 1], [1, 1, 0]])
    adv, ret = compute_reinforce_pp(rewards, mask, gamma=0.5)
    torch.testing.assert_close(ret, t([[0.25, 0.5, 1.0], [0.5, 1.0, 0.0]]))
    expected = naive_whiten([0.25, 0.5, 1.0, 0.5, 1.0])
    torch.testing.assert_close(adv[mask.bool()], t(expected))
    assert adv[1, 2] == 0


def test_reinforce_pp_baseline_hand_values():
    mask = t([[1, 1], [1, 0], [1, 1], [1, 1], [1, 0], [0, 1]])
    adv = compute_reinforce_pp_baseline(SCORES, UIDS, mask)
    centred = [0.5, -1, -0.5, -1, 0, 2]  # s - group mean; the lone c gets 0
    flat = [centred[i] for i in range(6) for j in range(2) if mask[i, j]]
    torch.testing.assert_close(adv[mask.bool()], t(naive_whiten(flat)))
    assert (adv[mask == 0] == 0).all()


def test_wrong_number_of_uids_is_an_error():
    with pytest.raises(ValueError, match="3 group ids .* batch of 6"):
        compute_grpo(SCORES, ["a", "a", "b"], ONES)


# ---- registry and token rewards ----------------------------------------------------------------


def test_scores_to_token_rewards_uses_last_valid_token():
    mask = t([[1, 1, 0], [1, 1, 1], [0, 0, 0], [1, 0, 1]])
    rewards = scores_to_token_rewards(t([1, 2, 3, 4]), mask)
    torch.testing.assert_close(rewards, t([[0, 1, 0], [0, 0, 2], [0, 0, 0], [0, 0, 4]]))


def test_registry_matches_direct_calls():
    mask = t([[1, 1, 0], [1, 1, 1], [1, 0, 0], [1, 1, 1]])
    scores, uids = t([1, 0, 2, 2]), ["x", "x", "y", "y"]
    rewards = scores_to_token_rewards(scores, mask)
    values = t([[0.1, 0.2, 0.3]] * 4)
    expected = {
        "gae": compute_gae(rewards, values, mask, 0.9, 0.8),
        "grpo": (compute_grpo(scores, uids, mask),) * 2,
        "rloo": (compute_rloo(scores, uids, mask),) * 2,
        "reinforce_pp": compute_reinforce_pp(rewards, mask, 0.9),
        "reinforce_pp_baseline": (compute_reinforce_pp_baseline(scores, uids, mask),) * 2,
    }
    assert set(expected) == set(ADVANTAGE_ESTIMATORS)
    for name, (adv, ret) in expected.items():
        got = compute_advantages(name, rewards, mask, values=values, uids=uids, gamma=0.9, lam=0.8)
        torch.testing.assert_close(got[0], adv)
        torch.testing.assert_close(got[1], ret)


def test_registry_errors_name_the_problem():
    mask = torch.ones(2, 2)
    with pytest.raises(ValueError, match="unknown advantage estimator 'ppo2'.*gae, grpo, rloo"):
        compute_advantages("ppo2", torch.zeros(2, 2), mask)
    with pytest.raises(ValueError, match="'gae' needs critic values"):
        compute_advantages("gae", torch.zeros(2, 2), mask)
    with pytest.raises(ValueError, match="'grpo' needs group ids"):
        compute_advantages("grpo", torch.zeros(2, 2), mask)


# ---- KL in the reward ------------------------------------------------------------------------------


def test_kl_penalty_hand_values():
    rewards, mask = t([[0.0, 1.0, 5.0], [0.0, 2.0, 0.0]]), t([[1, 1, 0], [1, 1, 1]])
    old, ref = t([[-1.0, -2.0, -3.0], [-1.0, -1.0, -1.0]]), t([[-1.5, -1.0, 0.0], [-1.0, -1.0, -2.0]])
    out, kl = apply_kl_penalty(rewards, old, ref, mask, coef=0.1, kl_type="k1")
    # k1 = old - ref = [[.5, -1, (masked)], [0, 0, 1]]
    torch.testing.assert_close(out, t([[-0.05, 1.1, 5.0], [0.0, 2.0, -0.1]]))
    assert kl == pytest.approx(((0.5 - 1.0) / 2 + 1.0 / 3) / 2)
    same, kl0 = apply_kl_penalty(rewards, old, old, mask, coef=0.1, kl_type="k3")
    torch.testing.assert_close(same, rewards)
    assert kl0 == 0.0


def test_kl_controllers():
    fixed = KLController(0.05)  # no target: the coefficient stays
    assert fixed.update(10.0, 100) == 0.05 and fixed.update(0.0, 100) == 0.05
    ctl = KLController(0.1, target_kl=1.0, horizon=100)
    assert ctl.update(1.5, 10) == pytest.approx(0.1 * (1 + 0.2 * 0.1))  # error clipped at +0.2
    assert ctl.update(0.9, 10) == pytest.approx(0.102 * (1 - 0.1 * 0.1))
    assert ctl.update(0.0, 10) == pytest.approx(0.10098 * (1 - 0.2 * 0.1))  # clipped at -0.2
    with pytest.raises(ValueError, match="target_kl > 0"):
        KLController(0.1, target_kl=0.0, horizon=10)


# ---- the spec's settings reach the step's arithmetic (controller/step_math.py) ----------------------


def step_batch(old: list[list[float]], ref: list[list[float]]) -> Batch:
    """Four samples of one prompt, two response tokens each (the second row's last one masked out)."""
    mask = torch.tensor([[1, 1], [1, 0], [1, 1], [1, 1]], dtype=torch.float32)
    tensors = {"response_mask": mask, "old_log_probs": torch.tensor(old), "ref_log_probs": torch.tensor(ref)}
    return Batch.from_dict(tensors=tensors, non_tensors={"uid": ["p"] * 4})


def test_norm_adv_by_std_divides_by_the_group_std_or_not():
    # scores [1, 0, 0, 0]: mean 0.25, unbiased std sqrt((0.75^2 + 3 * 0.25^2) / 3) = 0.5
    batch, scores = step_batch([[0.0] * 2] * 4, [[0.0] * 2] * 4), torch.tensor([1.0, 0.0, 0.0, 0.0])
    mask = batch.tensors["response_mask"]
    for norm, expected in ((True, [1.5, -0.5, -0.5, -0.5]), (False, [0.75, -0.25, -0.25, -0.25])):
        spec = JobSpec.model_validate({"algorithm": {"norm_adv_by_std": norm}})
        out, _ = add_advantages(batch, scores, spec, kl_coef=0.0)
        want = torch.tensor(expected)[:, None] * mask
        torch.testing.assert_close(out.tensors["advantages"], want, rtol=0, atol=1e-5)


def test_kl_in_reward_takes_the_coefficient_times_the_token_kl_off_the_rewards():
    old = [[-1.0, -2.0], [-1.0, -9.0], [-0.5, -0.5], [-2.0, -1.0]]
    ref = [[-1.5, -1.0], [-1.0, -1.0], [-0.5, -0.5], [-1.0, -1.0]]
    batch, scores = step_batch(old, ref), torch.tensor([1.0, 0.0, 0.0, 0.0])
    spec = JobSpec.model_validate({"algorithm": {"kl_in_reward": True, "kl_loss_type": "k1"}})
    out, metrics = add_advantages(batch, scores, spec, kl_coef=0.1)
    # k1 = old - ref on the response tokens: [[.5, -1], [0, (masked)], [0, 0], [-1, 0]]
    rewards = [[-0.05, 1.0 + 0.1], [0.0, 0.0], [0.0, 0.0], [0.1, 0.0]]
    torch.testing.assert_close(out.tensors["token_level_rewards"], torch.tensor(rewards))
    assert metrics["actor/reward_kl_penalty"] == pytest.approx((-0.25 + 0 + 0 - 0.5) / 4)
    assert metrics["actor/reward_kl_penalty_coeff"] == 0.1
    plain, none = add_advantages(batch, scores, JobSpec.model_validate({}), kl_coef=0.1)
    torch.testing.assert_close(plain.tensors["token_level_rewards"][:, 1], torch.tensor([1.0, 0, 0, 0]))
    assert none == {}


# ---- rows whose reward failed ----------------------------------------------------------------------


def failed_rows_batch() -> tuple[Batch, torch.Tensor]:
    """Three prompts of four samples, two response tokens each; False in SCORED: the reward failed
    (its score a 0.0 placeholder). Prompt a: scored [1, 0, 0.5] and one failure; b: one scored row;
    c: none."""
    scored = torch.tensor([True, True, False, True, False, True, False, False, False, False, False, False])
    scores = torch.tensor([1.0, 0.0, 0.0, 0.5, 0.0, 0.7, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0])
    tensors = {
        "response_mask": torch.ones(12, 2),
        "attention_mask": torch.ones(12, 3, dtype=torch.long),
        SCORED: scored,
    }
    return Batch.from_dict(tensors=tensors, non_tensors={"uid": list("aaaabbbbcccc")}), scores


@pytest.mark.parametrize(
    ("algorithm", "prompt_a"),
    [
        # scored [1, 0, 0.5]: mean 0.5, unbiased std sqrt((0.25 + 0.25 + 0) / 2) = 0.5
        ({"advantage": "grpo"}, [1.0, -1.0, 0.0, 0.0]),
        ({"advantage": "grpo", "norm_adv_by_std": False}, [0.5, -0.5, 0.0, 0.0]),  # Dr.GRPO
        ({"advantage": "rloo"}, [0.75, -0.75, 0.0, 0.0]),  # 3 / 2 * (s - 0.5)
    ],
)
def test_failed_rows_get_no_advantage_no_loss_mask_and_stay_out_of_their_group(algorithm, prompt_a):
    batch, scores = failed_rows_batch()
    out, _ = add_advantages(batch, scores, JobSpec.model_validate({"algorithm": algorithm}), kl_coef=0.0)
    advantages = out.tensors["advantages"]
    # Prompt b has one scored row, as a one-sample group: 0; prompt c none: 0, not NaN.
    want = torch.tensor(prompt_a + [0.0] * 8)[:, None].expand(12, 2)
    torch.testing.assert_close(advantages, want, rtol=0, atol=1e-5)
    assert out.tensors["response_mask"].sum(1).tolist() == [2, 2, 0, 2, 0, 2] + [0] * 6
    metrics = batch_metrics(out, scores, max_new_tokens=2)
    assert metrics["critic/score/mean"] == pytest.approx((1.0 + 0.0 + 0.5 + 0.7) / 4, abs=1e-6)
    assert metrics["critic/score/min"] == 0.0 and metrics["critic/score/max"] == 1.0


def test_failed_rows_stay_out_of_the_batch_whitening():
    """REINFORCE++-baseline: centred scores of prompt a [0.5, -0.5, 0] (b and c: 0) whitened over the
    8 tokens of the 4 rows that scored (two tokens each), not the batch's 24."""
    batch, scores = failed_rows_batch()
    spec = JobSpec.model_validate({"algorithm": {"advantage": "reinforce_pp_baseline"}})
    out, _ = add_advantages(batch, scores, spec, kl_coef=0.0)
    tokens = [0.5, 0.5, -0.5, -0.5, 0.0, 0.0, 0.0, 0.0]
    whitened = naive_whiten(tokens)
    want = torch.zeros(12, 2)
    for row, value in zip([0, 1, 3, 5], whitened[::2], strict=True):
        want[row] = value
    torch.testing.assert_close(out.tensors["advantages"], want, rtol=0, atol=1e-5)


def test_a_batch_whose_every_reward_failed_trains_nothing_and_reports_no_score():
    batch, scores = failed_rows_batch()
    batch.tensors[SCORED] = torch.zeros(12, dtype=torch.bool)
    batch.tensors["entropy"] = torch.ones(12, 2)  # the rollout's, when it reports one
    out, _ = add_advantages(batch, scores, JobSpec.model_validate({}), kl_coef=0.0)
    assert not out.tensors["advantages"].any() and not out.tensors["response_mask"].any()
    assert GlobalCounts.of([out.tensors]) == GlobalCounts(tokens=0, sequences=0, response_width=2)
    metrics = batch_metrics(out, scores, max_new_tokens=2)
    assert "critic/score/mean" not in metrics and "actor/rollout_entropy" not in metrics
    assert all(math.isfinite(v) for v in metrics.values())


def test_validation_scores_the_rows_that_scored_and_counts_the_others():
    """failed_rows_batch's scored rows are 1, 0, 0.5 and 0.7: mean 0.55, one of four at 1 or more; a
    validation whose every row failed has no mean and no accuracy (neither 0 nor NaN)."""
    from controller.step_math import validation_metrics

    batch, scores = failed_rows_batch()
    assert validation_metrics(batch, scores) == pytest.approx(
        {"val/score/mean": 0.55, "val/accuracy": 0.25, "val/unscored": 8.0}
    )
    batch.tensors[SCORED] = torch.zeros(12, dtype=torch.bool)
    assert validation_metrics(batch, scores) == {"val/unscored": 12.0}
    del batch.tensors[SCORED]  # a reward model's scores: every row
    assert validation_metrics(batch, scores)["val/score/mean"] == pytest.approx(2.2 / 12)
