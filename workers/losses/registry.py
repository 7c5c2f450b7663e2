"""The loss registry: every built-in per-token objective, RL's and the Tinker API's, under its name.

An objective reads `TokenInputs` and its options as keywords and returns a `TokenLoss`: the loss per
token, not yet weighted nor reduced, and where a clip is active. With r = exp(log pi - log mu) (mu
the behaviour policy), A the advantage, sg stop-gradient, clip(x) = clamp(x, low, high):

    cross_entropy        -log pi
    importance_sampling  -A r
    ppo                  max(-A r, -A clip(r)); with `dual_clip` c, where A < 0 also capped at -A c
    gspo                 ppo's clipped form on the sequence ratio s = exp(mean log(pi/mu) over the
                         sequence's ratio tokens), as s_t = sg[s] pi_t / sg[pi_t]
    cispo                -sg[clip(r)] A log pi (no token loses its gradient)
    stable_reinforce     cispo with bounds (0, cap), plus kl_coeff/2 (log pi - log mu)^2
    dro                  -(A log pi - beta/2 (log pi - log mu)^2)

`max_log_ratio` bounds log r before exp where given (RL jobs; the Tinker losses leave it free).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

Tensor = torch.Tensor
Bound = float | Tensor


class TokenInputs(NamedTuple):
    log_probs: Tensor  # the policy's log-probs of the targets, autograd-connected
    old_log_probs: Tensor | None = None  # the behaviour policy's (RL: old policy; Tinker: sampler)
    advantages: Tensor | None = None
    sequence_mask: Tensor | None = None  # the tokens of a sequence's ratio (gspo); None = all


class TokenLoss(NamedTuple):
    loss: Tensor  # per token, not yet weighted nor reduced
    clipped: Tensor  # bool: the ratio clip is active
    dual_clipped: Tensor  # bool: ppo's dual clip (-A c) is active


def _needs(value: Tensor | None, name: str) -> Tensor:
    if value is None:
        raise ValueError(f"this loss needs {name}")
    return value


def _ratio(inp: TokenInputs, max_log_ratio: float | None, detach: bool = False) -> Tensor:
    log_ratio = inp.log_probs - _needs(inp.old_log_probs, "old_log_probs")
    if detach:
        log_ratio = log_ratio.detach()
    if max_log_ratio is not None:
        log_ratio = log_ratio.clamp(-max_log_ratio, max_log_ratio)
    return log_ratio.exp()


def _unclipped(loss: Tensor) -> TokenLoss:
    none = torch.zeros_like(loss, dtype=torch.bool)
    return TokenLoss(loss, none, none)


def _clipped_surrogate(ratio: Tensor, advantages: Tensor, low: Bound, high: Bound) -> tuple[Tensor, Tensor]:
    """max(-A r, -A clip(r)) and where the clipped branch wins (the token then has no gradient)."""
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(low, high)
    return torch.maximum(unclipped, clipped), clipped > unclipped


def cross_entropy(inp: TokenInputs) -> TokenLoss:
    return _unclipped(-inp.log_probs)


def importance_sampling(inp: TokenInputs, max_log_ratio: float | None = None) -> TokenLoss:
    return _unclipped(-_needs(inp.advantages, "advantages") * _ratio(inp, max_log_ratio))


def ppo(
    inp: TokenInputs,
    low: Bound,
    high: Bound,
    dual_clip: float | None = None,
    max_log_ratio: float | None = None,
) -> TokenLoss:
    advantages = _needs(inp.advantages, "advantages")
    loss, clipped = _clipped_surrogate(_ratio(inp, max_log_ratio), advantages, low, high)
    if dual_clip is None:
        return TokenLoss(loss, clipped, torch.zeros_like(clipped))
    cap = -advantages * dual_clip
    dual_clipped = (advantages < 0) & (loss > cap)
    return TokenLoss(torch.where(dual_clipped, cap, loss), clipped, dual_clipped)


def gspo(inp: TokenInputs, low: Bound, high: Bound, max_log_ratio: float | None = None) -> TokenLoss:
    """An empty ratio mask gives s = 1."""
    log_probs = inp.log_probs
    mask = inp.sequence_mask if inp.sequence_mask is not None else torch.ones_like(log_probs)
    m = mask.to(log_probs.dtype)
    log_ratio = log_probs - _needs(inp.old_log_probs, "old_log_probs")
    seq_log_ratio = (log_ratio * m).sum(-1) / m.sum(-1).clamp(min=1)
    # Clamp only the detached value, so that every token keeps its own gradient.
    seq_value = seq_log_ratio.detach()
    if max_log_ratio is not None:
        seq_value = seq_value.clamp(-max_log_ratio, max_log_ratio)
    ratio = (seq_value.unsqueeze(-1) + log_probs - log_probs.detach()).exp()
    loss, clipped = _clipped_surrogate(ratio, _needs(inp.advantages, "advantages"), low, high)
    return TokenLoss(loss, clipped, torch.zeros_like(clipped))


def cispo(inp: TokenInputs, low: Bound, high: Bound, max_log_ratio: float | None = None) -> TokenLoss:
    ratio = _ratio(inp, max_log_ratio, detach=True)
    weight = ratio.clamp(low, high)
    clipped = (ratio < low) | (ratio > high)
    loss = -_needs(inp.advantages, "advantages") * weight * inp.log_probs
    return TokenLoss(loss, clipped, torch.zeros_like(clipped))


def stable_reinforce(inp: TokenInputs, cap: float, kl_coeff: float) -> TokenLoss:
    terms = cispo(inp, 0.0, cap)
    penalty = 0.5 * kl_coeff * (inp.log_probs - _needs(inp.old_log_probs, "old_log_probs")) ** 2
    return terms._replace(loss=terms.loss + penalty)


def dro(inp: TokenInputs, beta: float) -> TokenLoss:
    log_probs = inp.log_probs
    quad = (log_probs - _needs(inp.old_log_probs, "old_log_probs")) ** 2
    return _unclipped(-(log_probs * _needs(inp.advantages, "advantages") - 0.5 * beta * quad))


Objective = Callable[..., TokenLoss]

LOSSES: dict[str, Objective] = {
    "cross_entropy": cross_entropy,
    "importance_sampling": importance_sampling,
    "ppo": ppo,
    "gspo": gspo,
    "cispo": cispo,
    "stable_reinforce": stable_reinforce,
    "dro": dro,
}


def objective(name: str) -> Objective:
    if name not in LOSSES:
        raise ValueError(f"unknown loss {name!r}; registered losses: {', '.join(LOSSES)}")
    return LOSSES[name]
