"""Rollout correction: importance weights and rejection for the rollout engine / trainer mismatch.

The samples come from the rollout engine's policy pi_rollout, while the policy gradient is taken
for the trainer's pi_old (same weights, other kernels and precision). Per valid token t of
sequence i, with delta_it = log pi_old(y_it) - log pi_rollout(y_it) and rho_it = exp(delta_it):

    token TIS        w_it = min(rho_it, C)
                     Yao et al. 2025, "Your Efficient RL Framework Secretly Brings You Off-Policy
                     RL Training" (truncated importance sampling; C = 2 there).
    sequence TIS     w_it = min(rho_i, C),  rho_i = exp(sum_t delta_it)
                     Liu, Li et al. 2025, "When Speed Kills Stability: Demystifying RL Collapse
                     from the Training-Inference Mismatch": the sequence is the unit the reward
                     scores, so its likelihood ratio is the unbiased correction; the cap bounds
                     its variance.
    token rejection  keep_it = [low <= rho_it <= high]
                     masked IS at the token level (the Ling team's IcePop, 2025: tokens whose
                     ratio leaves a band are dropped from the gradient).
    sequence         keep_i = [low <= rho_i <= high]
    rejection        masked IS (MIS) of Liu, Li et al. 2025: a sequence whose ratio leaves the
                     band is dropped whole instead of being down-weighted.
    geometric        keep_i = [low <= exp(mean_t delta_it) <= high]
    rejection        the per-token geometric mean of the sequence ratio, which does not grow with
                     the length, so one band serves short and long answers (the geometric mode of
                     verl's rollout-correction write-up, 2025, after GSPO's length-normalised
                     sequence ratio, Zheng et al. 2025).

The weights multiply the per-token policy loss and are constants (no gradient flows through
them). When the old log-prob pass is skipped (one on-policy step), pi_old is the current forward's
detached log-probs, which have the same values, so the weights are the same.

Rejection changes which tokens count in the loss's normaliser, the global token (and sequence)
count that the engine takes from `response_mask` before the first forward (engines/base.py), so it
is applied to the batch's `response_mask` beforehand (`apply_rejection`) rather than as a zero
weight: a rejected token then weighs nothing and does not dilute the others.

`mismatch_metrics` is the train/inference report of every step, additive over micro-batches and
ranks like every loss metric (the max is reduced by max, engines/base.py).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from engines.base import GlobalCounts
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
    """The loss mask without the rejected tokens (same dtype as `mask`), and the shares rejected:
    rollout_corr/token_rejected_frac (of valid tokens) and rollout_corr/seq_rejected_frac (of the
    sequences with a valid token, those that lost all of them)."""
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
    """This micro-batch's share of the step's train/inference mismatch report:
    rollout/log_prob_diff_mean and _max (|delta|) and rollout/kl_rollout_trainer, the k3 estimate
    of KL(pi_rollout || pi_old) from tokens sampled by the rollout engine, E[rho - 1 - delta]."""
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
