"""Rollout correction: importance weights and rejection for the rollout engine / trainer mismatch.

Samples come from pi_rollout, the gradient is taken for pi_old (same weights, other kernels). Per
valid token, delta_it = log pi_old - log pi_rollout, rho = exp(delta):

    token TIS            w_it = min(rho_it, C)
    sequence TIS         w_it = min(rho_i, C),  rho_i = exp(sum_t delta_it)
    token rejection      keep_it = [low <= rho_it <= high]
    sequence rejection   keep_i = [low <= rho_i <= high]
    geometric rejection  keep_i = [low <= exp(mean_t delta_it) <= high]  (length-independent)

The weights are constants that multiply the per-token loss. Rejection changes which tokens count in
the loss's global normaliser, so it is applied to `response_mask` beforehand (`apply_rejection`).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from engines.training.base import GlobalCounts
from schema.losses import RolloutCorrectionConfig
from workers.losses.kl import kl_estimate

# exp(delta) past this overflows in low precision; ratios this far out are truncated or rejected anyway.
_MAX_LOG_RATIO = 20.0


class ISWeights(NamedTuple):
    weights: torch.Tensor  # [mb, R] the truncated IS weight of every token (1 where masked)
    truncated: torch.Tensor  # [mb, R] bool: the cap C was active


def _log_ratio(
    old_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """delta = log pi_old - log pi_rollout on the valid tokens, 0 elsewhere; detached."""
    return ((old_log_probs - rollout_log_probs) * mask.to(old_log_probs.dtype)).detach()


def is_weights(
    old_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor, mask: torch.Tensor, level: str, cap: float
) -> ISWeights:
    """The truncated importance weights of `level` ('token' or 'sequence'); see the module doc."""
    delta = _log_ratio(old_log_probs, rollout_log_probs, mask)
    if level == "token":
        log_rho = delta
    elif level == "sequence":
        log_rho = delta.sum(-1, keepdim=True).expand_as(delta)
    else:
        raise ValueError(f"unknown is_weights level {level!r}; choose token or sequence")
    rho = log_rho.clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO).exp()
    return ISWeights(rho.clamp(max=cap), rho > cap)


def rejection_keep(
    old_log_probs: torch.Tensor,
    rollout_log_probs: torch.Tensor,
    mask: torch.Tensor,
    level: str,
    low: float,
    high: float,
) -> torch.Tensor:
    """[B, R] bool: the valid tokens that stay in the loss under rejection `level`; see the module doc."""
    m = mask.bool()
    delta = _log_ratio(old_log_probs, rollout_log_probs, mask)
    if level == "token":
        log_rho = delta
    elif level == "sequence":
        log_rho = delta.sum(-1, keepdim=True)
    elif level == "geometric":
        log_rho = delta.sum(-1, keepdim=True) / m.sum(-1, keepdim=True).clamp(min=1)
    else:
        raise ValueError(f"unknown rejection level {level!r}; choose token, sequence or geometric")
    # Compared in log space: no overflow for long sequences.
    inside = (log_rho >= math.log(low)) & (log_rho <= math.log(high))
    return m & inside


def apply_rejection(
    mask: torch.Tensor,
    old_log_probs: torch.Tensor,
    rollout_log_probs: torch.Tensor,
    cfg: RolloutCorrectionConfig,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The loss mask without the rejected tokens (same dtype), and the token and sequence shares rejected."""
    keep = rejection_keep(
        old_log_probs, rollout_log_probs, mask, cfg.rejection, cfg.rejection_low, cfg.rejection_high
    )
    valid = mask.bool()
    live = valid.any(-1)
    metrics = {
        "rollout_corr/token_rejected_frac": float((valid & ~keep).sum()) / max(int(valid.sum()), 1),
        "rollout_corr/seq_rejected_frac": float((live & ~keep.any(-1)).sum()) / max(int(live.sum()), 1),
    }
    return keep.to(mask.dtype), metrics


def mismatch_metrics(
    old_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor, mask: torch.Tensor, counts: GlobalCounts
) -> dict[str, float]:
    """This micro-batch's share of the train/inference mismatch: |delta| mean and max, and the k3
    estimate of KL(pi_rollout || pi_old)."""
    m = mask.to(old_log_probs.dtype)
    gap = _log_ratio(old_log_probs, rollout_log_probs, mask).abs()
    kl = kl_estimate(rollout_log_probs.detach(), old_log_probs.detach(), "k3") * m
    tokens = max(counts.tokens, 1)
    return {
        "rollout/log_prob_diff_mean": float(gap.sum()) / tokens,
        "rollout/log_prob_diff_max": float(gap.max()) if gap.numel() else 0.0,
        "rollout/kl_rollout_trainer": float(kl.sum()) / tokens,
    }


def is_weight_metrics(terms: ISWeights, mask: torch.Tensor, counts: GlobalCounts) -> dict[str, float]:
    """rollout_corr/is_weight_mean and rollout_corr/token_clipped_frac, as additive shares."""
    m = mask.to(terms.weights.dtype)
    tokens = max(counts.tokens, 1)
    return {
        "rollout_corr/is_weight_mean": float((terms.weights * m).sum()) / tokens,
        "rollout_corr/token_clipped_frac": float((terms.truncated.to(m.dtype) * m).sum()) / tokens,
    }
