"""Policy, value and SFT losses: hand-computed values, clip accounting, and micro-batch additivity."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError
from tensordict import TensorDict

from engines.training.base import GlobalCounts, combine_metric
from schema.losses import RolloutCorrectionConfig
from schema.training import AlgorithmSpec
from workers.losses import (
    AGG_MODES,
    PolicyLossConfig,
    aggregate,
    kl_estimate,
    make_policy_loss,
    make_sft_loss,
    make_value_loss,
)

D = torch.float64


def t(rows) -> torch.Tensor:
    return torch.tensor(rows, dtype=D)


def counts_of(mask: torch.Tensor) -> GlobalCounts:
    return GlobalCounts(int(mask.sum()), mask.shape[0], mask.shape[1])


def batch(**tensors: torch.Tensor) -> TensorDict:
    return TensorDict(tensors, batch_size=[next(iter(tensors.values())).shape[0]])


def run(loss_fn, mb: TensorDict, outputs: dict[str, torch.Tensor], counts: GlobalCounts | None = None):
    return loss_fn(mb, outputs, counts or counts_of(mb["response_mask"]))


# ---- aggregation -----------------------------------------------------------------------------------


def test_aggregate_hand_values():
    loss, mask = t([[1, 2, 3], [4, 5, 6]]), t([[1, 1, 0], [1, 0, 0]])
    counts = GlobalCounts(tokens=3, sequences=2, response_width=3)
    expected = {
        "token-mean": 7 / 3,
        "seq-mean-token-sum": (3 + 4) / 2,
        "seq-mean-token-mean": (1.5 + 4) / 2,
        "seq-mean-token-sum-norm": 7 / 6,
    }
    assert set(expected) == set(AGG_MODES)
    for mode, value in expected.items():
        assert aggregate(loss, mask, mode, counts).item() == pytest.approx(value)
    with pytest.raises(ValueError, match="unknown loss_agg_mode 'mean'.*token-mean"):
        aggregate(loss, mask, "mean", counts)


# ---- PPO -------------------------------------------------------------------------------------------

# Per token: (advantage, ratio). Clip low 0.2, high 0.3, dual clip c = 3.
PPO_CASES = [
    (1.0, 1.5),  # above 1 + high with A > 0: clipped, loss -1.3
    (1.0, 0.5),  # below 1 - low with A > 0: the unclipped branch wins, loss -0.5
    (-1.0, 0.5),  # below 1 - low with A < 0: clipped, loss 0.8
    (-1.0, 4.0),  # A < 0 and -A r = 4 > c: dual clipped, loss 3
    (-1.0, 2.0),  # A < 0, 2 < c: neither, loss 2
    (2.0, 1.0),  # ratio 1: loss -2
    (1.0, 2.0),  # masked out: must not count anywhere
]
PPO_LOSSES = [-1.3, -0.5, 0.8, 3.0, 2.0, -2.0]


def ppo_inputs(cases=PPO_CASES):
    adv = t([[a for a, _ in cases]])
    log_probs = t([[-1.0 - 0.1 * i for i in range(len(cases))]]).requires_grad_()
    old = log_probs.detach() - torch.log(t([[r for _, r in cases]]))
    mask = t([[1] * (len(cases) - 1) + [0]])
    return batch(response_mask=mask, old_log_probs=old, advantages=adv), log_probs


def test_ppo_hand_values_clip_fractions_and_gradient():
    cfg = PolicyLossConfig(clip_ratio_low=0.2, clip_ratio_high=0.3, clip_ratio_c=3.0)
    mb, log_probs = ppo_inputs()
    loss, metrics = run(make_policy_loss(cfg), mb, {"log_probs": log_probs})
    assert loss.item() == pytest.approx(sum(PPO_LOSSES) / 6)
    assert metrics["actor/pg_loss"] == pytest.approx(sum(PPO_LOSSES) / 6)
    assert metrics["actor/pg_clipfrac"] == pytest.approx(2 / 6)  # tokens 0 and 2
    assert metrics["actor/pg_clipfrac_lower"] == pytest.approx(1 / 6)  # token 3
    log_ratios = [math.log(r) for _, r in PPO_CASES[:6]]
    assert metrics["actor/ppo_kl"] == pytest.approx(-sum(log_ratios) / 6)
    assert "actor/entropy" not in metrics and "actor/kl_loss" not in metrics
    loss.backward()
    # d(-A r)/d log pi = -A r where the unclipped branch is active; 0 where a clip is.
    expected = [0.0, -0.5 / 6, 0.0, 0.0, 2.0 / 6, -2.0 / 6, 0.0]
    torch.testing.assert_close(log_probs.grad, t([expected]))


def test_ppo_with_equal_policies_is_minus_mean_advantage():
    g = torch.Generator().manual_seed(0)
    adv = torch.randn(3, 5, generator=g, dtype=D)
    mask = t([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0]])
    log_probs = -torch.rand(3, 5, generator=g, dtype=D)
    mb = batch(response_mask=mask, old_log_probs=log_probs.clone(), advantages=adv)
    loss, metrics = run(make_policy_loss(PolicyLossConfig()), mb, {"log_probs": log_probs})
    assert loss.item() == pytest.approx(-(adv * mask).sum().item() / mask.sum().item())
    assert metrics["actor/pg_clipfrac"] == 0 and metrics["actor/ppo_kl"] == 0


# ---- GSPO and CISPO --------------------------------------------------------------------------------


def test_gspo_uses_the_length_normalised_sequence_ratio():
    cfg = PolicyLossConfig(policy_loss="gspo", clip_ratio_low=0.2, clip_ratio_high=0.3)
    cfg = cfg.model_copy(update={"loss_agg_mode": "seq-mean-token-mean"})
    log_probs = t([[-1.0, -2.0, -3.0], [-1.0, -1.5, -0.5]]).requires_grad_()
    # Row 0: log ratios ln 2, 0 (and a masked 5): s = sqrt(2) > 1.3, A = 1, both tokens clipped at -1.3.
    # Row 1: every log ratio ln 0.9: s = 0.9 inside the range, A = [-1, -2, -3], loss -A * 0.9.
    log_ratio = t([[math.log(2.0), 0.0, 5.0], [math.log(0.9)] * 3])
    mb = batch(
        response_mask=t([[1, 1, 0], [1, 1, 1]]),
        old_log_probs=log_probs.detach() - log_ratio,
        advantages=t([[1.0, 1.0, 1.0], [-1.0, -2.0, -3.0]]),
    )
    loss, metrics = run(make_policy_loss(cfg), mb, {"log_probs": log_probs})
    assert loss.item() == pytest.approx((-1.3 + 0.9 * (1 + 2 + 3) / 3) / 2)
    assert metrics["actor/pg_clipfrac"] == pytest.approx(2 / 5)
    assert metrics["actor/pg_clipfrac_lower"] == 0
    loss.backward()
    # Token-level straight-through: token t gets -A_t s / (2 * 3), its own advantage only (the
    # non-detached sequence form would spread the mean advantage, 0.3, over every token).
    torch.testing.assert_close(log_probs.grad, t([[0.0, 0.0, 0.0], [0.9 / 6, 1.8 / 6, 2.7 / 6]]))


def test_cispo_clips_and_detaches_the_weight():
    cfg = PolicyLossConfig(policy_loss="cispo", clip_ratio_low=0.2, clip_ratio_high=0.3)
    log_probs = t([[-1.0, -2.0, -0.5]]).requires_grad_()
    ratios, adv = t([[1.5, 0.5, 1.0]]), t([[1.0, -1.0, 2.0]])
    mb = batch(response_mask=t([[1, 1, 1]]), old_log_probs=log_probs.detach() - ratios.log(), advantages=adv)
    loss, metrics = run(make_policy_loss(cfg), mb, {"log_probs": log_probs})
    # weights clip(r) = [1.3, 0.8, 1.0]; loss_t = -A w log pi = [1.3, -1.6, 1.0]
    assert loss.item() == pytest.approx((1.3 - 1.6 + 1.0) / 3)
    assert metrics["actor/pg_clipfrac"] == pytest.approx(2 / 3)
    loss.backward()
    # Every token keeps a gradient, -A w, even where the weight is clipped.
    torch.testing.assert_close(log_probs.grad, t([[-1.3 / 3, 0.8 / 3, -2.0 / 3]]))


# ---- entropy and KL terms --------------------------------------------------------------------------


def test_kl_estimators_hand_values_and_properties():
    lp, ref = t([-1.0, -2.0]), t([-2.0, -1.0])  # d = +1, -1
    torch.testing.assert_close(kl_estimate(lp, ref, "k1"), t([1.0, -1.0]))
    torch.testing.assert_close(kl_estimate(lp, ref, "k2"), t([0.5, 0.5]))
    torch.testing.assert_close(kl_estimate(lp, ref, "k3"), t([math.exp(-1), math.exp(1) - 2]))
    torch.testing.assert_close(kl_estimate(lp, ref, "low_var_kl"), kl_estimate(lp, ref, "k3"))
    g = torch.Generator().manual_seed(1)
    a, b = -torch.rand(50, generator=g, dtype=D) * 5, -torch.rand(50, generator=g, dtype=D) * 5
    for kind in ("k1", "k2", "k3"):
        assert (kl_estimate(a, a, kind) == 0).all()
    assert (kl_estimate(a, b, "k3") >= 0).all()
    assert kl_estimate(t([-50.0]), t([0.0]), "k3").item() == 10.0  # clamped to [-10, 10]
    with pytest.raises(ValueError, match="unknown KL estimator 'k4'.*k1, k2, k3"):
        kl_estimate(a, b, "k4")


def test_entropy_bonus_and_kl_loss_terms():
    mask = t([[1, 1, 0], [1, 0, 0]])
    log_probs = t([[-1.0, -2.0, -3.0], [-0.5, -1.0, -1.0]])
    ref = t([[-2.0, -2.0, 0.0], [-0.5, -3.0, -3.0]])
    entropy = t([[0.3, 0.6, 9.0], [0.9, 9.0, 9.0]])
    mb = batch(
        response_mask=mask, old_log_probs=log_probs, advantages=t([[1.0] * 3, [-2.0] * 3]), ref_log_probs=ref
    )
    cfg = PolicyLossConfig(entropy_coeff=0.01, use_kl_loss=True, kl_loss_coef=0.1, kl_loss_type="k1")
    loss, metrics = run(make_policy_loss(cfg), mb, {"log_probs": log_probs, "entropy": entropy})
    pg, ent, kl = (-1 - 1 + 2) / 3, (0.3 + 0.6 + 0.9) / 3, (1.0 + 0.0 + 0.0) / 3
    assert metrics["actor/pg_loss"] == pytest.approx(pg)
    assert metrics["actor/entropy"] == pytest.approx(ent)
    assert metrics["actor/kl_loss"] == pytest.approx(kl)
    assert loss.item() == pytest.approx(pg - 0.01 * ent + 0.1 * kl)
    # With no entropy bonus the entropy is still reported (the dashboard's Entropy chart) but not in the loss.
    loss, metrics = run(
        make_policy_loss(PolicyLossConfig()), mb, {"log_probs": log_probs, "entropy": entropy}
    )
    assert metrics["actor/entropy"] == pytest.approx(ent)
    assert loss.item() == pytest.approx(pg)


def test_missing_inputs_are_clear_errors():
    mb = batch(response_mask=t([[1.0]]), old_log_probs=t([[-1.0]]), advantages=t([[1.0]]))
    with pytest.raises(ValueError, match="compute_entropy=True"):
        run(make_policy_loss(PolicyLossConfig(entropy_coeff=0.1)), mb, {"log_probs": t([[-1.0]])})
    with pytest.raises(KeyError, match="ref_log_probs"):
        run(make_policy_loss(PolicyLossConfig(use_kl_loss=True)), mb, {"log_probs": t([[-1.0]])})


# ---- value and SFT ---------------------------------------------------------------------------------


def test_value_loss_hand_values():
    mask = t([[1, 1, 1, 0]])
    mb = batch(response_mask=mask, values=t([[0.5, 2.0, 0.0, 0.0]]), returns=t([[2.0, 1.0, 0.5, 9.0]]))
    vpred = t([[1.0, 2.0, 0.0, 5.0]]).requires_grad_()
    loss, metrics = run(make_value_loss(vf_clip=0.2), mb, {"values": vpred})
    # token 0: unclipped (1-2)^2 = 1 < clipped (0.7-2)^2 = 1.69; token 1: 1 = 1; token 2: .25 = .25
    assert loss.item() == pytest.approx(0.5 * (1.69 + 1.0 + 0.25) / 3)
    assert metrics == pytest.approx(
        {"critic/vf_loss": 0.49, "critic/vf_clipfrac": 1 / 3, "critic/vpred_mean": 1.0}
    )
    loss.backward()
    torch.testing.assert_close(vpred.grad, t([[0.0, 1.0 / 3, -0.5 / 3, 0.0]]))
    unclipped, _ = run(make_value_loss(vf_clip=None), mb, {"values": vpred})
    assert unclipped.item() == pytest.approx(0.5 * (1.0 + 1.0 + 0.25) / 3)


def test_sft_loss_is_masked_negative_log_likelihood():
    mb = batch(response_mask=t([[1, 1, 0], [1, 0, 0]]))
    loss, metrics = run(
        make_sft_loss("token-mean"), mb, {"log_probs": t([[-1.0, -2.0, -7.0], [-3.0, -7.0, -7.0]])}
    )
    assert loss.item() == pytest.approx(2.0) and metrics == {"sft/loss": pytest.approx(2.0)}


# ---- micro-batch additivity ------------------------------------------------------------------------


def random_batch(seed: int) -> tuple[TensorDict, dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    b, r = 4, 5
    mask = t([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [1, 0, 0, 0, 0], [1, 1, 1, 1, 0]])
    log_probs = -torch.rand(b, r, generator=g, dtype=D) * 3
    mb = batch(
        response_mask=mask,
        old_log_probs=log_probs + 0.4 * torch.randn(b, r, generator=g, dtype=D),
        ref_log_probs=log_probs + 0.4 * torch.randn(b, r, generator=g, dtype=D),
        rollout_log_probs=log_probs + 0.6 * torch.randn(b, r, generator=g, dtype=D),
        advantages=torch.randn(b, r, generator=g, dtype=D),
        values=torch.randn(b, r, generator=g, dtype=D),
        returns=torch.randn(b, r, generator=g, dtype=D),
    )
    outputs = {
        "log_probs": log_probs,
        "entropy": torch.rand(b, r, generator=g, dtype=D),
        "values": mb["values"] + 0.3 * torch.randn(b, r, generator=g, dtype=D),
    }
    return mb, outputs


def split_run(loss_fn, mb: TensorDict, outputs: dict[str, torch.Tensor], size: int):
    """Sum of losses, metrics and gradients over micro-batches of `size` rows, with global counts."""
    leaves = {k: v.clone().requires_grad_() for k, v in outputs.items()}
    counts = counts_of(mb["response_mask"])
    total, metrics = torch.zeros((), dtype=D), {}
    for start in range(0, mb.shape[0], size):
        rows = slice(start, start + size)
        loss, m = loss_fn(mb[rows], {k: v[rows] for k, v in leaves.items()}, counts)
        loss.backward()
        total = total + loss.detach()
        for k, v in m.items():
            combine_metric(metrics, k, v)
    return total, metrics, {k: v.grad for k, v in leaves.items()}


def loss_fns(mode: str):
    common = {"loss_agg_mode": mode, "entropy_coeff": 0.01, "use_kl_loss": True, "kl_loss_coef": 0.1}
    yield "ppo", make_policy_loss(PolicyLossConfig(policy_loss="ppo", clip_ratio_high=0.28, **common))
    yield "gspo", make_policy_loss(PolicyLossConfig(policy_loss="gspo", kl_loss_type="k2", **common))
    yield "cispo", make_policy_loss(PolicyLossConfig(policy_loss="cispo", kl_loss_type="k1", **common))
    token_tis = RolloutCorrectionConfig(is_weights="token", is_cap=1.5)
    yield "ppo+token-tis", make_policy_loss(PolicyLossConfig(rollout_correction=token_tis, **common))
    seq_tis = RolloutCorrectionConfig(is_weights="sequence", is_cap=1.5)
    yield (
        "gspo+seq-tis",
        make_policy_loss(PolicyLossConfig(policy_loss="gspo", rollout_correction=seq_tis, **common)),
    )
    yield "value", make_value_loss(0.2, mode)
    yield "sft", make_sft_loss(mode)


@pytest.mark.parametrize("mode", AGG_MODES)
def test_micro_batch_split_gives_the_whole_batch_loss_gradient_and_metrics(mode: str):
    mb, outputs = random_batch(seed=7)
    for name, loss_fn in loss_fns(mode):
        whole_loss, whole_metrics, whole_grads = split_run(loss_fn, mb, outputs, size=4)
        assert whole_metrics, name
        for size in (1, 2):
            loss, metrics, grads = split_run(loss_fn, mb, outputs, size)
            assert abs(loss.item() - whole_loss.item()) <= 1e-6, (name, size)
            assert metrics == pytest.approx(whole_metrics, abs=1e-6), (name, size)
            for key, grad in whole_grads.items():
                if grad is None:
                    assert grads[key] is None, (name, key)
                else:
                    torch.testing.assert_close(
                        grads[key], grad, atol=1e-6, rtol=0, msg=f"{name} {size} {key}"
                    )
        if name != "value":
            assert whole_grads["log_probs"].abs().sum() > 0, name
        if name.endswith("tis"):  # the cap bites on some tokens, not all
            assert 0 < whole_metrics["rollout_corr/token_clipped_frac"] < 1, name


# ---- config ----------------------------------------------------------------------------------------


def test_config_matches_algorithm_spec_and_rejects_unknowns():
    spec_fields = AlgorithmSpec.model_fields
    for name, field in PolicyLossConfig.model_fields.items():
        assert name in spec_fields, name
        assert field.default == spec_fields[name].default, name
    picked = AlgorithmSpec(policy_loss="gspo", kl_loss_type="k2").model_dump(
        include=set(PolicyLossConfig.model_fields)
    )
    assert PolicyLossConfig(**picked).policy_loss == "gspo"
    with pytest.raises(ValidationError, match="policy_loss"):
        PolicyLossConfig(policy_loss="trpo")
    with pytest.raises(ValidationError, match="clip_eps"):
        PolicyLossConfig(clip_eps=0.2)
    with pytest.raises(ValueError, match="unknown loss_agg_mode 'sum'"):
        make_value_loss(0.2, "sum")
    with pytest.raises(ValueError, match="unknown loss_agg_mode 'sum'"):
        make_sft_loss("sum")
    with pytest.raises(ValueError, match="unknown policy_loss 'trpo'"):
        make_policy_loss(PolicyLossConfig.model_construct(policy_loss="trpo"))


def test_losses_do_not_import_the_controller():
    for path in (Path(__file__).parents[1] / "workers" / "losses").glob("*.py"):
        source = path.read_text()
        assert "import controller" not in source and "from controller" not in source, path
        assert "import ray" not in source, path


# ---- rollout correction ----------------------------------------------------------------------------


def corrected(**options) -> PolicyLossConfig:
    return PolicyLossConfig(rollout_correction=RolloutCorrectionConfig(**options))


def test_token_tis_weights_each_token_by_its_truncated_ratio():
    # On-policy PPO (ratio 1), so each token's loss is -A times its IS weight min(rho, 2).
    log_probs = t([[-1.0, -2.0, -0.5, -1.0]]).requires_grad_()
    rho = t([[0.5, 3.0, 1.0, 9.0]])  # the last token is masked out
    mb = batch(
        response_mask=t([[1, 1, 1, 0]]),
        old_log_probs=log_probs.detach().clone(),
        rollout_log_probs=log_probs.detach() - rho.log(),
        advantages=t([[1.0, 2.0, -1.0, 5.0]]),
    )
    loss, metrics = run(
        make_policy_loss(corrected(is_weights="token", is_cap=2.0)), mb, {"log_probs": log_probs}
    )
    assert loss.item() == pytest.approx((-1 * 0.5 - 2 * 2.0 + 1 * 1.0) / 3)
    assert metrics["rollout_corr/token_clipped_frac"] == pytest.approx(1 / 3)
    assert metrics["rollout_corr/is_weight_mean"] == pytest.approx((0.5 + 2.0 + 1.0) / 3)
    assert metrics["rollout/log_prob_diff_max"] == pytest.approx(math.log(3.0))
    loss.backward()
    torch.testing.assert_close(log_probs.grad, t([[-0.5 / 3, -4.0 / 3, 1.0 / 3, 0.0]]))


def test_sequence_tis_weights_every_token_by_the_truncated_sequence_ratio():
    log_probs = t([[-1.0, -1.0, -1.0], [-2.0, -2.0, -2.0]])
    # Row 0: rho_i = 2 * 0.75 = 1.5 (the masked 5.0 does not count); row 1: 2 * 2 = 4, capped at 2.
    log_rho = t([[math.log(2.0), math.log(0.75), 5.0], [math.log(2.0), math.log(2.0), 0.0]])
    mb = batch(
        response_mask=t([[1, 1, 0], [1, 1, 0]]),
        old_log_probs=log_probs.clone(),
        rollout_log_probs=log_probs - log_rho,
        advantages=torch.ones(2, 3, dtype=D),
    )
    loss, metrics = run(
        make_policy_loss(corrected(is_weights="sequence", is_cap=2.0)), mb, {"log_probs": log_probs}
    )
    assert loss.item() == pytest.approx(-(1.5 * 2 + 2.0 * 2) / 4)
    assert metrics["rollout_corr/token_clipped_frac"] == pytest.approx(2 / 4)
    assert metrics["rollout_corr/is_weight_mean"] == pytest.approx((1.5 * 2 + 2.0 * 2) / 4)


# Ratios rho per token (0 = masked); the band is [0.5, 2].
REJECTION_RHO = [[1.0, 3.0, 0.4], [2.5, 2.5, 0], [0.9, 0, 0], [1.5, 1.5, 1.5]]
REJECTION_CASES = {
    # level: (kept mask, token share rejected, sequence share rejected)
    "token": ([[1, 0, 0], [0, 0, 0], [1, 0, 0], [1, 1, 1]], 4 / 9, 1 / 4),
    # products 1.2, 6.25, 0.9, 3.375
    "sequence": ([[1, 1, 1], [0, 0, 0], [1, 0, 0], [0, 0, 0]], 5 / 9, 2 / 4),
    # geometric means 1.2^(1/3), 2.5, 0.9, 1.5
    "geometric": ([[1, 1, 1], [0, 0, 0], [1, 0, 0], [1, 1, 1]], 2 / 9, 1 / 4),
}


@pytest.mark.parametrize("level", sorted(REJECTION_CASES))
def test_rejection_drops_tokens_or_sequences_whose_ratio_leaves_the_band(level: str):
    from workers.losses.rollout_correction import apply_rejection

    rho = t(REJECTION_RHO)
    mask = (rho > 0).long()
    old = -torch.rand(4, 3, generator=torch.Generator().manual_seed(3), dtype=D)
    rollout = old - torch.where(mask.bool(), rho, torch.ones_like(rho)).log()
    cfg = RolloutCorrectionConfig(rejection=level, rejection_low=0.5, rejection_high=2.0)
    keep, metrics = apply_rejection(mask, old, rollout, cfg)
    expected_keep, token_share, seq_share = REJECTION_CASES[level]
    assert keep.dtype == mask.dtype and keep.tolist() == expected_keep
    assert metrics["rollout_corr/token_rejected_frac"] == pytest.approx(token_share)
    assert metrics["rollout_corr/seq_rejected_frac"] == pytest.approx(seq_share)


def test_mismatch_report_hand_values_and_no_correction_by_default():
    log_probs = t([[-1.0, -2.0, -3.0]])
    delta = t([[0.5, -1.0, 7.0]])  # the 7.0 is masked out
    mb = batch(
        response_mask=t([[1, 1, 0]]),
        old_log_probs=log_probs.clone(),
        rollout_log_probs=log_probs - delta,
        advantages=t([[1.0, 1.0, 1.0]]),
    )
    loss, metrics = run(make_policy_loss(PolicyLossConfig()), mb, {"log_probs": log_probs})
    assert loss.item() == pytest.approx(-1.0)  # uncorrected: -mean(A)
    assert metrics["rollout/log_prob_diff_mean"] == pytest.approx(1.5 / 2)
    assert metrics["rollout/log_prob_diff_max"] == pytest.approx(1.0)
    # KL(rollout || trainer) by k3: mean of rho - 1 - delta.
    k3 = [math.exp(d) - 1 - d for d in (0.5, -1.0)]
    assert metrics["rollout/kl_rollout_trainer"] == pytest.approx(sum(k3) / 2)
    assert not any(k.startswith("rollout_corr/") for k in metrics)


def test_rollout_correction_options_are_validated():
    with pytest.raises(ValidationError, match="is_cap"):
        RolloutCorrectionConfig(is_cap=0.5)
    with pytest.raises(ValidationError, match="rejection_low .* must be below"):
        RolloutCorrectionConfig(rejection_low=1.0, rejection_high=1.0)
    with pytest.raises(ValidationError, match="rejection"):
        AlgorithmSpec(rollout_correction={"rejection": "chunk"})
    with pytest.raises(KeyError, match="rollout_log_probs"):
        mb = batch(response_mask=t([[1.0]]), old_log_probs=t([[-1.0]]), advantages=t([[1.0]]))
        run(make_policy_loss(corrected(is_weights="token")), mb, {"log_probs": t([[-1.0]])})
