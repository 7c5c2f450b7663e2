"""Policy-gradient losses for the actor: PPO (clipped), GSPO and CISPO, plus entropy and KL terms.

Each objective maps per-token log-probs to a per-token loss matrix, with the tokens where a clip is
active flagged for the metrics. Writing r = exp(log pi - log pi_old) and A for the advantage:

    ppo    max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high)), and where A < 0 additionally capped at
           -A c (dual clip): a very large ratio on a bad token cannot blow the loss up.
    gspo   the same clipped form, but r is the sequence ratio s_i = exp(mean_t log(pi/pi_old)) over
           the valid tokens of sequence i, in its token-level form s_it = sg[s_i] pi_t / sg[pi_t]:
           the value of s_i, the gradient of each token's own log-prob.
    cispo  -sg[clip(r, 1 - eps_low, 1 + eps_high)] A log pi: the IS weight is clipped and detached,
           so no token loses its gradient (unlike PPO, where a clipped token contributes none).

`make_policy_loss` weights the matrix by the rollout correction's truncated IS weights when they
are on (rollout_correction.py), aggregates it with the configured mode (see aggregation.py), subtracts
entropy_coeff * entropy and adds kl_loss_coef * KL(pi || pi_ref), following engines/base.py's loss
contract: everything is divided by the global counts, so losses and metrics add up over
micro-batches and ranks. With the rollout engine's log-probs in the batch it also reports the
train/inference mismatch (rollout/*).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import NamedTuple

import torch
from tensordict import TensorDict

from engines.base import GlobalCounts, LossFn
from workers.loss_config import PolicyLossConfig, RolloutCorrectionConfig
from workers.losses.aggregation import aggregate, check_agg_mode, token_fraction, token_mean
from workers.losses.kl import kl_estimate
from workers.losses.rollout_correction import is_weight_metrics, is_weights, mismatch_metrics

# Bounds the log-ratio before exp: beyond it the ratio is clipped anyway, and exp would overflow.
_MAX_LOG_RATIO = 20.0


class TokenPolicyLoss(NamedTuple):
    loss: torch.Tensor  # [mb, R] per-token loss, not yet masked
    clipped: torch.Tensor  # [mb, R] bool: the ratio clip is active
    dual_clipped: torch.Tensor  # [mb, R] bool: PPO's dual clip (-A c) is active


def _clipped_surrogate(
    ratio: torch.Tensor, advantages: torch.Tensor, low: float, high: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """max(-A r, -A clip(r)) and where the clipped branch wins (the token then has no gradient)."""
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - low, 1.0 + high)
    return torch.maximum(unclipped, clipped), clipped > unclipped


def ppo_token_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_ratio_low: float,
    clip_ratio_high: float,
    clip_ratio_c: float,
) -> TokenPolicyLoss:
    """PPO's clipped objective with asymmetric clip and dual clip (see the module doc)."""
    ratio = (log_probs - old_log_probs).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO).exp()
    loss, clipped = _clipped_surrogate(ratio, advantages, clip_ratio_low, clip_ratio_high)
    cap = -advantages * clip_ratio_c
    dual_clipped = (advantages < 0) & (loss > cap)
    return TokenPolicyLoss(torch.where(dual_clipped, cap, loss), clipped, dual_clipped)


def gspo_token_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_ratio_low: float,
    clip_ratio_high: float,
) -> TokenPolicyLoss:
    """GSPO-token: the clipped objective on the length-normalised sequence ratio (see the module doc).

    The GSPO paper uses loss_agg_mode 'seq-mean-token-mean' and very small clip ranges (3e-4, 4e-4)."""
    m = mask.to(log_probs.dtype)
    seq_log_ratio = ((log_probs - old_log_probs) * m).sum(-1) / m.sum(-1).clamp(min=1)
    # Clamp only the detached value, so that every token keeps its own gradient.
    seq_value = seq_log_ratio.detach().clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO).unsqueeze(-1)
    ratio = (seq_value + log_probs - log_probs.detach()).exp()
    loss, clipped = _clipped_surrogate(ratio, advantages, clip_ratio_low, clip_ratio_high)
    return TokenPolicyLoss(loss, clipped, torch.zeros_like(clipped))


def cispo_token_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_ratio_low: float,
    clip_ratio_high: float,
) -> TokenPolicyLoss:
    """CISPO: REINFORCE weighted by the clipped, detached IS ratio (see the module doc)."""
    ratio = (log_probs - old_log_probs).detach().clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO).exp()
    weight = ratio.clamp(1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    clipped = (ratio < 1.0 - clip_ratio_low) | (ratio > 1.0 + clip_ratio_high)
    return TokenPolicyLoss(-advantages * weight * log_probs, clipped, torch.zeros_like(clipped))


def _rollout_corrected(
    token_loss: torch.Tensor,
    micro_batch: TensorDict,
    old_log_probs: torch.Tensor,
    counts: GlobalCounts,
    correction: RolloutCorrectionConfig,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The token losses times the truncated IS weights (when on), and the mismatch report."""
    if "rollout_log_probs" not in micro_batch.keys():
        if correction.is_weights != "off":
            raise KeyError("rollout_correction.is_weights needs 'rollout_log_probs' in the batch")
        return token_loss, {}
    mask, rollout_log_probs = micro_batch["response_mask"], micro_batch["rollout_log_probs"]
    metrics = mismatch_metrics(old_log_probs, rollout_log_probs, mask, counts)
    if correction.is_weights != "off":
        terms = is_weights(old_log_probs, rollout_log_probs, mask, correction.is_weights, correction.is_cap)
        token_loss = token_loss * terms.weights.to(token_loss.dtype)
        metrics.update(is_weight_metrics(terms, mask, counts))
    return token_loss, metrics


def _masked_abs_max(values: torch.Tensor, mask: torch.Tensor) -> float:
    picked = values.detach()[mask.bool()]
    return float(picked.abs().max()) if picked.numel() else 0.0


TokenObjective = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], TokenPolicyLoss]


def make_token_objective(cfg: PolicyLossConfig) -> TokenObjective:
    """The per-token objective of `cfg.policy_loss`, with its clip ranges bound."""
    clips = {"clip_ratio_low": cfg.clip_ratio_low, "clip_ratio_high": cfg.clip_ratio_high}
    objectives: dict[str, TokenObjective] = {
        "ppo": partial(ppo_token_loss, clip_ratio_c=cfg.clip_ratio_c, **clips),
        "gspo": partial(gspo_token_loss, **clips),
        "cispo": partial(cispo_token_loss, **clips),
    }
    if cfg.policy_loss not in objectives:
        raise ValueError(f"unknown policy_loss {cfg.policy_loss!r}; choose one of {', '.join(objectives)}")
    return objectives[cfg.policy_loss]


def make_policy_loss(cfg: PolicyLossConfig) -> LossFn:
    """The actor's LossFn. Reads micro_batch response_mask, old_log_probs, advantages (and
    ref_log_probs with use_kl_loss, rollout_log_probs when present), outputs log_probs (and
    entropy). Metrics: actor/pg_loss, actor/pg_clipfrac, actor/pg_clipfrac_lower, actor/ppo_kl,
    actor/entropy, actor/kl_loss, rollout/* and rollout_corr/* (see rollout_correction.py)."""
    objective = make_token_objective(cfg)
    check_agg_mode(cfg.loss_agg_mode)  # fail at construction, not at the first micro-batch

    def policy_loss(
        micro_batch: TensorDict, outputs: dict[str, torch.Tensor], counts: GlobalCounts
    ) -> tuple[torch.Tensor, dict[str, float]]:
        mask = micro_batch["response_mask"]
        log_probs, old_log_probs = outputs["log_probs"], micro_batch["old_log_probs"]
        terms = objective(log_probs, old_log_probs, micro_batch["advantages"], mask)
        token_loss, metrics = _rollout_corrected(
            terms.loss, micro_batch, old_log_probs, counts, cfg.rollout_correction
        )
        pg_loss = aggregate(token_loss, mask, cfg.loss_agg_mode, counts)
        metrics.update(
            {
                "actor/pg_loss": float(pg_loss.detach()),
                "actor/pg_clipfrac": token_fraction(terms.clipped, mask, counts),
                "actor/pg_clipfrac_lower": token_fraction(terms.dual_clipped, mask, counts),
                "actor/ppo_kl": token_mean(old_log_probs - log_probs, mask, counts),
                # the PPO ratio's farthest token from 1: exp(+-this) (a sign of an unstable update)
                "actor/log_ratio_max": _masked_abs_max(log_probs - old_log_probs, mask),
            }
        )
        loss = pg_loss
        if "entropy" in outputs:
            entropy = aggregate(outputs["entropy"], mask, cfg.loss_agg_mode, counts)
            metrics["actor/entropy"] = float(entropy.detach())
            if cfg.entropy_coeff != 0:
                loss = loss - cfg.entropy_coeff * entropy
        elif cfg.entropy_coeff != 0:
            raise ValueError("entropy_coeff needs outputs['entropy']: run with compute_entropy=True")
        if cfg.use_kl_loss:
            if "ref_log_probs" not in micro_batch.keys():
                raise KeyError("use_kl_loss needs 'ref_log_probs' in the batch: compute reference log-probs")
            kl = aggregate(
                kl_estimate(log_probs, micro_batch["ref_log_probs"], cfg.kl_loss_type),
                mask,
                cfg.loss_agg_mode,
                counts,
            )
            metrics["actor/kl_loss"] = float(kl.detach())
            loss = loss + cfg.kl_loss_coef * kl
        return loss, metrics

    return policy_loss


def rows_with_gradient(cfg: PolicyLossConfig, micro_batch: TensorDict) -> torch.Tensor | None:
    """[B] bool: the rows whose policy loss can have a non-zero gradient; None when all can.

    Every objective above is the advantage times a factor per token, and the rollout correction
    only multiplies it by a weight, so a row whose advantage is exactly 0 on every valid token
    contributes exactly 0 to the gradient (GRPO: a group whose samples all scored the same). The
    entropy bonus and the KL loss do not vanish with the advantage: with either, every row counts.
    """
    if cfg.entropy_coeff != 0 or cfg.use_kl_loss:
        return None
    mask = micro_batch["response_mask"].bool()
    return (micro_batch["advantages"].ne(0) & mask).any(dim=-1)
