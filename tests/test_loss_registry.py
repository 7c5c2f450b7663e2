"""The loss registry (workers/losses/registry.py): every RL and Tinker loss is registered under its
name, and a loss both sides compute gives the same value and gradient through the RL path
(`make_policy_loss` / `make_sft_loss` over a padded batch) and the Tinker path (`compute_loss` over
per-datum log-probs) on the same tokens. Float64 throughout: the two paths sum the same terms in
another order, so they agree to rounding (TOL)."""

from __future__ import annotations

import math
import random
from typing import get_args

import pytest
import torch
from tensordict import TensorDict

from engines.training.base import GlobalCounts
from schema.losses import PolicyLossConfig
from schema.tinker_losses import LOSS_NAMES
from workers.losses import LOSSES, aggregate, make_policy_loss, make_sft_loss, objective
from workers.losses.tinker import compute_loss

TOL = 1e-12
D = torch.float64


def test_every_rl_and_tinker_loss_is_registered_once():
    rl_names = set(get_args(PolicyLossConfig.model_fields["policy_loss"].annotation))
    assert rl_names | set(LOSS_NAMES) == set(LOSSES)
    assert rl_names <= set(LOSS_NAMES)  # the RL objectives are Tinker losses too: one function each
    with pytest.raises(ValueError, match="unknown loss 'nope'.*ppo"):
        objective("nope")


def test_sum_reduction_weights_without_counts_and_rl_modes_need_counts():
    loss, weights = torch.tensor([[1.0, 2.0], [3.0, 4.0]], dtype=D), torch.tensor([[1, 0.5], [0, 2]], dtype=D)
    assert aggregate(loss, None, "sum").item() == 10.0
    assert aggregate(loss, weights, "sum").item() == 1 + 1 + 8
    with pytest.raises(ValueError, match="'token-mean' needs the valid-token mask and the global counts"):
        aggregate(loss, weights, "token-mean")


def _data(seed: int) -> list[dict[str, torch.Tensor]]:
    """Response tokens of a few sequences of different lengths, ratios on both sides of the clip."""
    rng = random.Random(seed)
    data = []
    for n in (5, 2, 7):
        sampler = torch.tensor([math.log(rng.uniform(0.05, 0.95)) for _ in range(n)], dtype=D)
        # |log ratio| <= 0.6: the ratio leaves [0.8, 1.2] but stays below PPO's dual clip (3)
        shift = torch.tensor([rng.uniform(-0.6, 0.6) for _ in range(n)], dtype=D)
        adv = torch.tensor([rng.uniform(-2, 2) for _ in range(n)], dtype=D)
        data.append({"lp": sampler + shift, "logprobs": sampler, "advantages": adv})
    return data


def _rl(name: str, data: list[dict]) -> tuple[float, list[torch.Tensor], dict[str, float]]:
    rows, width = len(data), max(len(d["lp"]) for d in data)
    lp, old, adv, mask = (torch.zeros(rows, width, dtype=D) for _ in range(4))
    for i, d in enumerate(data):
        n = len(d["lp"])
        lp[i, :n], old[i, :n], adv[i, :n], mask[i, :n] = d["lp"], d["logprobs"], d["advantages"], 1
    lp.requires_grad_()
    mb = TensorDict({"response_mask": mask, "old_log_probs": old, "advantages": adv}, batch_size=[rows])
    # seq-mean-token-sum over `rows` sequences: the sum over every valid token, divided by rows
    counts = GlobalCounts(tokens=int(mask.sum()), sequences=rows, response_width=width)
    mode = "seq-mean-token-sum"
    if name == "cross_entropy":
        loss_fn = make_sft_loss(mode)
    else:  # RL's clip 0.2 / 0.2 is Tinker's default 0.8 / 1.2
        loss_fn = make_policy_loss(PolicyLossConfig(policy_loss=name, loss_agg_mode=mode))
    loss, metrics = loss_fn(mb, {"log_probs": lp}, counts)
    loss.backward()
    return loss.item() * rows, [lp.grad[i, : len(d["lp"])] * rows for i, d in enumerate(data)], metrics


def _tinker(name: str, data: list[dict]) -> tuple[float, list[torch.Tensor]]:
    lps = [d["lp"].clone().requires_grad_() for d in data]
    inputs = []
    for d in data:
        n = len(d["lp"])
        inp = {"target_tokens": torch.zeros(n, dtype=torch.int64)}
        if name == "cross_entropy":
            inp["weights"] = torch.ones(n, dtype=D)
        else:
            inp.update(logprobs=d["logprobs"], advantages=d["advantages"])
        if name == "gspo":
            inp["sequence_ratio_mask"] = torch.ones(n, dtype=D)
        inputs.append(inp)
    loss, _, metrics = compute_loss(name, lps, inputs, None)
    loss.backward()
    assert metrics["loss:sum"] == loss.item()
    return loss.item(), [lp.grad for lp in lps]


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("name", ["ppo", "gspo", "cispo", "cross_entropy"])
def test_a_shared_loss_gives_the_same_value_and_gradient_through_rl_and_tinker(name, seed):
    data = _data(seed)
    rl_loss, rl_grads, metrics = _rl(name, data)
    tinker_loss, tinker_grads = _tinker(name, data)
    assert rl_loss == pytest.approx(tinker_loss, rel=TOL, abs=TOL)
    for mine, theirs in zip(rl_grads, tinker_grads, strict=True):
        torch.testing.assert_close(mine, theirs, rtol=TOL, atol=TOL)
    assert any(g.abs().sum() > 0 for g in tinker_grads)
    if name in ("ppo", "cispo"):
        assert metrics["actor/pg_clipfrac"] > 0  # the clip is exercised, not only the inner branch
