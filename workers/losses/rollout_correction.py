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

import torch

from engines.training.base import GlobalCounts
from schema.losses import RolloutCorrectionConfig
from workers.losses.aggregation import token_mean
from workers.losses.kl import MAX_LOG_RATIO, kl_estimate


def _log_rho(
    old_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor, mask: torch.Tensor, level: str
) -> torch.Tensor:
    """Detached log rho of each valid token ([B, R], 0 elsewhere) or of its sequence ([B, 1]) at `level`."""
    delta = ((old_log_probs - rollout_log_probs) * mask.to(old_log_probs.dtype)).detach()
    if level == "token":
        return delta
    if level == "sequence":
        return delta.sum(-1, keepdim=True)
    if level == "geometric":
        return delta.sum(-1, keepdim=True) / mask.bool().sum(-1, keepdim=True).clamp(min=1)
    raise ValueError(f"unknown rollout-correction level {level!r}; choose token, sequence or geometric")


def is_weights(
    old_log_probs: torch.Tensor,
    rollout_log_probs: torch.Tensor,
    mask: torch.Tensor,
    level: str,
    cap: float,
    counts: GlobalCounts,
) -> tuple[torch.Tensor, dict[str, float]]:
    """[mb, R] truncated importance weights of `level` (see the module doc), and as additive shares
    their mean and the share of tokens where the cap C was active."""
    log_rho = _log_rho(old_log_probs, rollout_log_probs, mask, level)
    rho = log_rho.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO).exp().expand_as(old_log_probs)
    weights = rho.clamp(max=cap)
    return weights, {
        "rollout_corr/is_weight_mean": token_mean(weights, mask, counts),
        "rollout_corr/token_clipped_frac": token_mean((rho > cap).to(weights.dtype), mask, counts),
    }


def rejection_keep(
    old_log_probs: torch.Tensor,
    rollout_log_probs: torch.Tensor,
    mask: torch.Tensor,
    level: str,
    low: float,
    high: float,
) -> torch.Tensor:
    """[B, R] bool: the valid tokens that stay in the loss under rejection `level`; see the module doc."""
    log_rho = _log_rho(old_log_probs, rollout_log_probs, mask, level)
    # Compared in log space: no overflow for long sequences.
    return mask.bool() & (log_rho >= math.log(low)) & (log_rho <= math.log(high))


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
    gap = _log_rho(old_log_probs, rollout_log_probs, mask, "token").abs()
    kl = kl_estimate(rollout_log_probs.detach(), old_log_probs.detach(), "k3")
    return {
        "rollout/log_prob_diff_mean": token_mean(gap, mask, counts),
        "rollout/log_prob_diff_max": float(gap.max()) if gap.numel() else 0.0,
        "rollout/kl_rollout_trainer": token_mean(kl, mask, counts),
    }
