"""Advantage estimators (run on the controller between the rollout and the update) and the KL penalty
in the reward.

Every estimator maps token rewards [B, R] and the response mask (with critic values or group ids) to
per-token advantages [B, R], zero on masked positions: GAE and REINFORCE++ from a reward per token;
GRPO, RLOO and REINFORCE++-baseline compare the n samples of one prompt (one "uid") by their summed
token rewards, and a group of one sample gets 0. A row whose reward could not be computed (`scored`
False) is not scored: it gets no advantage and stays out of its group's statistics and the batch's
whitening, so its group counts the rows that scored only. KL in the reward is r'_t = r_t - beta * KL_t, beta
fixed or adapted toward a target KL (Ziegler et al., 2019).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import numpy as np
import torch

from workers.losses.kl import kl_estimate

Uids = np.ndarray | Sequence[Hashable]


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """(x - mean) / sqrt(var + eps) over the masked-in tokens (unbiased variance); 0 elsewhere."""
    m = mask.to(values.dtype)
    n = m.sum()
    mean = (values * m).sum() / n.clamp(min=1)
    var = ((values - mean).square() * m).sum() / (n - 1).clamp(min=1)
    return (values - mean) * torch.rsqrt(var + eps) * m


def scores_to_token_rewards(scores: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """[B, R]: each sequence's score on its last valid response token, 0 elsewhere."""
    mask = response_mask.bool()
    positions = torch.arange(mask.shape[1], device=mask.device).expand_as(mask)
    last = torch.where(mask, positions, -1).amax(dim=1)  # -1 where the row is empty
    rewards = torch.zeros(mask.shape, dtype=scores.dtype, device=scores.device)
    has_token = last >= 0
    rows = torch.arange(mask.shape[0], device=mask.device)[has_token]
    rewards[rows, last[has_token]] = scores[has_token]
    return rewards


@torch.no_grad()
def compute_gae(
    token_rewards: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: float,
    lam: float,
    whiten: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE over a row's valid tokens (masked positions skipped): delta_t = r_t + gamma V_next - V_t,
    A_t = delta_t + gamma lam A_next, returns = A_t + V_t (not whitened); (advantages, returns)."""
    mask = response_mask.bool()
    next_value = torch.zeros_like(values[:, 0])
    next_adv = torch.zeros_like(values[:, 0])
    advantages = torch.zeros_like(values)
    for t in reversed(range(values.shape[1])):
        valid = mask[:, t]
        delta = token_rewards[:, t] + gamma * next_value - values[:, t]
        adv = delta + gamma * lam * next_adv
        advantages[:, t] = torch.where(valid, adv, 0.0)
        next_value = torch.where(valid, values[:, t], next_value)
        next_adv = torch.where(valid, adv, next_adv)
    returns = (advantages + values) * mask
    if whiten:
        advantages = masked_whiten(advantages, mask)
    return advantages, returns


def _group_index(uids: Uids, batch_size: int) -> tuple[torch.Tensor, int]:
    ids = list(uids)
    if len(ids) != batch_size:
        raise ValueError(f"got {len(ids)} group ids (uids) for a batch of {batch_size} sequences")
    numbers: dict[Hashable, int] = {}
    index = [numbers.setdefault(uid, len(numbers)) for uid in ids]
    return torch.tensor(index, dtype=torch.long), len(numbers)


def _as_float(x: torch.Tensor) -> torch.Tensor:
    return x if x.is_floating_point() else x.to(torch.float32)


def _group_stats(
    scores: torch.Tensor, uids: Uids, scored: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per row: the size, mean and unbiased std of its group's scored rows; size 0 for a row not
    scored, so that `size > 1` picks the rows that get an advantage."""
    group, n_groups = _group_index(uids, scores.shape[0])
    group = group.to(scores.device)
    weight = torch.ones_like(scores) if scored is None else scored.to(scores)
    size = torch.zeros(n_groups, dtype=scores.dtype, device=scores.device).index_add_(0, group, weight)
    mean = torch.zeros_like(size).index_add_(0, group, scores * weight) / size.clamp(min=1)
    sq_dev = torch.zeros_like(size).index_add_(0, group, (scores - mean[group]).square() * weight)
    std = (sq_dev / (size - 1).clamp(min=1)).sqrt()
    return size[group] * weight, mean[group], std[group]


@torch.no_grad()
def compute_grpo(
    scores: torch.Tensor,
    uids: Uids,
    response_mask: torch.Tensor,
    norm_by_std: bool = True,
    epsilon: float = 1e-6,
    scored: torch.Tensor | None = None,
) -> torch.Tensor:
    """GRPO: A_i = (s_i - mean_g) / (std_g + epsilon) on the valid tokens; norm_by_std=False is
    Dr.GRPO (no std division, so near-equal groups are not blown up)."""
    scores = _as_float(scores)
    size, mean, std = _group_stats(scores, uids, scored)
    adv = scores - mean
    if norm_by_std:
        adv = adv / (std + epsilon)
    adv = torch.where(size > 1, adv, 0.0)
    return adv.unsqueeze(-1) * response_mask


@torch.no_grad()
def compute_rloo(
    scores: torch.Tensor, uids: Uids, response_mask: torch.Tensor, scored: torch.Tensor | None = None
) -> torch.Tensor:
    """RLOO: A_i = s_i - mean of the group's other scores = n / (n - 1) * (s_i - mean_g)."""
    scores = _as_float(scores)
    size, mean, _ = _group_stats(scores, uids, scored)
    adv = torch.where(size > 1, (scores - mean) * size / (size - 1).clamp(min=1), 0.0)
    return adv.unsqueeze(-1) * response_mask


@torch.no_grad()
def compute_reinforce_pp(
    token_rewards: torch.Tensor, response_mask: torch.Tensor, gamma: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++: G_t = r_t + gamma G_next over a row's valid tokens, A = whiten(G) over the batch."""
    mask = response_mask.bool()
    returns = torch.zeros_like(token_rewards)
    running = torch.zeros_like(token_rewards[:, 0])
    for t in reversed(range(token_rewards.shape[1])):
        valid = mask[:, t]
        running = torch.where(valid, token_rewards[:, t] + gamma * running, running)
        returns[:, t] = torch.where(valid, running, 0.0)
    return masked_whiten(returns, mask), returns


@torch.no_grad()
def compute_reinforce_pp_baseline(
    scores: torch.Tensor, uids: Uids, response_mask: torch.Tensor, scored: torch.Tensor | None = None
) -> torch.Tensor:
    """REINFORCE++-baseline: A = whiten(s_i - mean_g) over the batch's valid tokens (the batch sets
    the scale, steadier than GRPO's per-group std)."""
    scores = _as_float(scores)
    size, mean, _ = _group_stats(scores, uids, scored)
    centred = torch.where(size > 1, scores - mean, 0.0)
    return masked_whiten(centred.unsqueeze(-1) * response_mask, response_mask)


ADVANTAGE_ESTIMATORS = ("gae", "grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline")
_GROUP_ESTIMATORS = {
    "grpo": compute_grpo,
    "rloo": compute_rloo,
    "reinforce_pp_baseline": compute_reinforce_pp_baseline,
}


def compute_advantages(
    name: str,
    token_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    values: torch.Tensor | None = None,
    uids: Uids | None = None,
    gamma: float = 1.0,
    lam: float = 1.0,
    norm_by_std: bool = True,
    whiten: bool = True,
    epsilon: float = 1e-6,
    scored: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages, returns), both [B, R], from the estimator `name` (an AlgorithmSpec.advantage);
    `scored` [B] bool: the rows whose reward was computed (None: all)."""
    if name not in ADVANTAGE_ESTIMATORS:
        raise ValueError(
            f"unknown advantage estimator {name!r}; choose one of {', '.join(ADVANTAGE_ESTIMATORS)}"
        )
    if scored is not None:
        response_mask = response_mask * scored.unsqueeze(-1).to(response_mask.dtype)
    if name == "gae":
        if values is None:
            raise ValueError(f"advantage estimator {name!r} needs critic values (values=[B, R])")
        return compute_gae(token_rewards, values, response_mask, gamma, lam, whiten)
    if name == "reinforce_pp":
        return compute_reinforce_pp(token_rewards, response_mask, gamma)
    if uids is None:
        raise ValueError(f"advantage estimator {name!r} needs group ids (uids), one per sequence")
    scores = (token_rewards * response_mask).sum(dim=-1)
    options = {"norm_by_std": norm_by_std, "epsilon": epsilon} if name == "grpo" else {}
    adv = _GROUP_ESTIMATORS[name](scores, uids, response_mask, scored=scored, **options)
    return adv, adv  # outcome methods have no critic: "returns" are the advantages, as is customary


# ---- KL in the reward ----------------------------------------------------------------------------


@torch.no_grad()
def apply_kl_penalty(
    token_rewards: torch.Tensor,
    old_log_probs: torch.Tensor,
    ref_log_probs: torch.Tensor,
    response_mask: torch.Tensor,
    coef: float,
    kl_type: str = "k1",
) -> tuple[torch.Tensor, float]:
    """(penalised token rewards [B, R], the batch KL: the mean over sequences of their mean token KL)."""
    mask = response_mask.to(token_rewards.dtype)
    kl = kl_estimate(old_log_probs, ref_log_probs, kl_type) * mask
    seq_kl = kl.sum(dim=-1) / mask.sum(dim=-1).clamp(min=1)
    return token_rewards - coef * kl, float(seq_kl.mean()) if seq_kl.numel() else 0.0


class KLController:
    """The KL-in-reward coefficient beta: fixed, or with a `target_kl` adapted after each step of n
    samples, beta *= 1 + clip(kl / target - 1, -0.2, 0.2) * n / horizon."""

    def __init__(self, coef: float, target_kl: float | None = None, horizon: int = 10_000) -> None:
        if target_kl is not None and (target_kl <= 0 or horizon <= 0):
            raise ValueError(f"adaptive KL needs target_kl > 0 and horizon > 0, got {target_kl}, {horizon}")
        self.value, self.target_kl, self.horizon = coef, target_kl, horizon

    def update(self, current_kl: float, n_steps: int) -> float:
        if self.target_kl is not None:
            error = min(max(current_kl / self.target_kl - 1.0, -0.2), 0.2)
            self.value *= 1.0 + error * n_steps / self.horizon
        return self.value
