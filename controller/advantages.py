"""Advantage estimators, run on the controller between the rollout and the update.

Every estimator maps what the rollout produced (token-level rewards [B, R], the response mask and,
depending on the method, critic values or group ids) to per-token advantages [B, R] that are zero on
masked positions. Two families:

* token-level, from a reward per token: GAE (with a critic) and REINFORCE++ (discounted returns);
* outcome-level, from one score per sequence, the masked sum of its token rewards: GRPO, RLOO and
  REINFORCE++-baseline compare the n samples of one prompt (one group id, "uid") with each other.

A group of one sample has nothing to be compared with, so its centred score is 0 in every group
method (GRPO and RLOO: advantage 0; REINFORCE++-baseline: 0 before the batch whitening).
`compute_advantages(name, ...)` picks an estimator by the names AlgorithmSpec uses. The KL-in-reward
helpers (penalty and coefficient controllers) live in kl_reward.py.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

Uids = np.ndarray | Sequence[Hashable]


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """(x - mean) / sqrt(var + eps) over the tokens where mask is 1, with the unbiased variance
    (n - 1 in the denominator); masked positions come out as 0."""
    m = mask.to(values.dtype)
    n = m.sum()
    mean = (values * m).sum() / n.clamp(min=1)
    var = ((values - mean).square() * m).sum() / (n - 1).clamp(min=1)
    return (values - mean) * torch.rsqrt(var + eps) * m


def scores_to_token_rewards(scores: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Token-level rewards [B, R]: each sequence's score on its last valid response token, 0 elsewhere.
    A row without any valid token gets no reward."""
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
    """Generalised advantage estimation; returns (advantages, returns), both [B, R].

    Over the valid tokens t < t' < ... of a row (masked positions are skipped, as if absent):
        delta_t = r_t + gamma * V_{next} - V_t         (V_next = 0 after the last valid token)
        A_t     = delta_t + gamma * lam * A_{next}
        returns = A_t + V_t                             (the critic's regression target)
    With lam = 1 this is the discounted reward-to-go minus V_t; with lam = 0 the one-step TD error.
    `whiten` normalises the advantages over all valid tokens of the batch; returns are not whitened.
    """
    mask = response_mask.bool()
    next_value = torch.zeros_like(values[:, 0])
    next_adv = torch.zeros_like(values[:, 0])
    advantages = torch.zeros_like(values)
    for t in reversed(range(values.shape[1])):
        valid = mask[:, t]
        delta = token_rewards[:, t] + gamma * next_value - values[:, t]
        adv = delta + gamma * lam * next_adv
        advantages[:, t] = torch.where(valid, adv, 0.0)
        # A masked position leaves the carried value and advantage untouched: it contributes nothing.
        next_value = torch.where(valid, values[:, t], next_value)
        next_adv = torch.where(valid, adv, next_adv)
    returns = (advantages + values) * mask
    if whiten:
        advantages = masked_whiten(advantages, mask)
    return advantages, returns


def _group_index(uids: Uids, batch_size: int) -> tuple[torch.Tensor, int]:
    """Row -> group number (0..G-1, by first appearance) for hashable group ids."""
    ids = list(uids)
    if len(ids) != batch_size:
        raise ValueError(f"got {len(ids)} group ids (uids) for a batch of {batch_size} sequences")
    numbers: dict[Hashable, int] = {}
    index = [numbers.setdefault(uid, len(numbers)) for uid in ids]
    return torch.tensor(index, dtype=torch.long), len(numbers)


def _as_float(x: torch.Tensor) -> torch.Tensor:
    """Integer or bool scores as float32; float64 stays float64."""
    return x if x.is_floating_point() else x.to(torch.float32)


def _group_stats(scores: torch.Tensor, uids: Uids) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per row: the size, mean and unbiased std of its group's scores."""
    group, n_groups = _group_index(uids, scores.shape[0])
    group = group.to(scores.device)
    size = torch.zeros(n_groups, dtype=scores.dtype, device=scores.device).index_add_(
        0, group, torch.ones_like(scores)
    )
    mean = torch.zeros_like(size).index_add_(0, group, scores) / size
    sq_dev = torch.zeros_like(size).index_add_(0, group, (scores - mean[group]).square())
    std = (sq_dev / (size - 1).clamp(min=1)).sqrt()
    return size[group], mean[group], std[group]


@torch.no_grad()
def compute_grpo(
    scores: torch.Tensor,
    uids: Uids,
    response_mask: torch.Tensor,
    norm_by_std: bool = True,
    epsilon: float = 1e-6,
) -> torch.Tensor:
    """GRPO's group-relative advantage, broadcast to the valid tokens: [B, R].

    A_i = (s_i - mean_g) / (std_g + epsilon), mean and (unbiased) std over the group g of sample i.
    norm_by_std=False gives Dr.GRPO, A_i = s_i - mean_g: no std division, so groups whose scores
    barely differ do not get their tiny differences blown up. Groups of one sample get 0.
    """
    scores = _as_float(scores)
    size, mean, std = _group_stats(scores, uids)
    adv = scores - mean
    if norm_by_std:
        adv = adv / (std + epsilon)
    adv = torch.where(size > 1, adv, 0.0)
    return adv.unsqueeze(-1) * response_mask


@torch.no_grad()
def compute_rloo(scores: torch.Tensor, uids: Uids, response_mask: torch.Tensor) -> torch.Tensor:
    """REINFORCE leave-one-out, broadcast to the valid tokens: [B, R].

    A_i = s_i - mean_{j in g, j != i} s_j, the baseline being the mean score of the *other* samples
    of the group, which keeps the estimate unbiased. Equal to n / (n - 1) * (s_i - mean_g) for a
    group of n. Groups of one sample get 0.
    """
    scores = _as_float(scores)
    size, mean, _ = _group_stats(scores, uids)
    adv = torch.where(size > 1, (scores - mean) * size / (size - 1).clamp(min=1), 0.0)
    return adv.unsqueeze(-1) * response_mask


@torch.no_grad()
def compute_reinforce_pp(
    token_rewards: torch.Tensor, response_mask: torch.Tensor, gamma: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++: discounted returns, whitened over the batch; returns (advantages, returns).

    G_t = r_t + gamma * G_{next} over the valid tokens of a row (masked positions skipped), then
    A = whiten(G) over all valid tokens of the batch: the batch statistics act as the baseline.
    """
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
    scores: torch.Tensor, uids: Uids, response_mask: torch.Tensor
) -> torch.Tensor:
    """REINFORCE++-baseline: A = whiten(s_i - mean_g) broadcast to tokens, whitened over all valid
    tokens of the batch. The group mean removes the prompt's difficulty, the batch whitening sets the
    scale (steadier than GRPO's per-group std). Groups of one sample get 0 before whitening.
    """
    scores = _as_float(scores)
    size, mean, _ = _group_stats(scores, uids)
    centred = torch.where(size > 1, scores - mean, 0.0)
    return masked_whiten(centred.unsqueeze(-1) * response_mask, response_mask)


@dataclass(frozen=True)
class AdvantageInputs:
    """What the estimators may read; each one checks that the fields it needs are present."""

    token_rewards: torch.Tensor  # [B, R]
    response_mask: torch.Tensor  # [B, R]
    values: torch.Tensor | None = None  # [B, R], GAE only
    uids: Uids | None = None  # group ids, group methods only
    gamma: float = 1.0
    lam: float = 1.0
    norm_by_std: bool = True
    whiten: bool = True
    epsilon: float = 1e-6

    @property
    def scores(self) -> torch.Tensor:
        """One score per sequence: the sum of its token rewards over the valid tokens."""
        return (self.token_rewards * self.response_mask).sum(dim=-1)

    def need_values(self, name: str) -> torch.Tensor:
        if self.values is None:
            raise ValueError(f"advantage estimator {name!r} needs critic values (values=[B, R])")
        return self.values

    def need_uids(self, name: str) -> Uids:
        if self.uids is None:
            raise ValueError(f"advantage estimator {name!r} needs group ids (uids), one per sequence")
        return self.uids


def _gae(x: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor]:
    return compute_gae(x.token_rewards, x.need_values("gae"), x.response_mask, x.gamma, x.lam, x.whiten)


def _grpo(x: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor]:
    adv = compute_grpo(x.scores, x.need_uids("grpo"), x.response_mask, x.norm_by_std, x.epsilon)
    return adv, adv  # outcome methods have no critic: "returns" are the advantages, as is customary


def _rloo(x: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor]:
    adv = compute_rloo(x.scores, x.need_uids("rloo"), x.response_mask)
    return adv, adv


def _reinforce_pp(x: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor]:
    return compute_reinforce_pp(x.token_rewards, x.response_mask, x.gamma)


def _reinforce_pp_baseline(x: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor]:
    adv = compute_reinforce_pp_baseline(x.scores, x.need_uids("reinforce_pp_baseline"), x.response_mask)
    return adv, adv


ADVANTAGE_ESTIMATORS: dict[str, Callable[[AdvantageInputs], tuple[torch.Tensor, torch.Tensor]]] = {
    "gae": _gae,
    "grpo": _grpo,
    "rloo": _rloo,
    "reinforce_pp": _reinforce_pp,
    "reinforce_pp_baseline": _reinforce_pp_baseline,
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
) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages, returns), both [B, R], from the estimator `name` (an AlgorithmSpec.advantage).

    Outcome methods score each sequence by the masked sum of its token rewards, so rewards built
    with `scores_to_token_rewards` (and a KL penalty, if any) work for every estimator.
    """
    if name not in ADVANTAGE_ESTIMATORS:
        raise ValueError(
            f"unknown advantage estimator {name!r}; choose one of {', '.join(ADVANTAGE_ESTIMATORS)}"
        )
    inputs = AdvantageInputs(
        token_rewards, response_mask, values, uids, gamma, lam, norm_by_std, whiten, epsilon
    )
    return ADVANTAGE_ESTIMATORS[name](inputs)
