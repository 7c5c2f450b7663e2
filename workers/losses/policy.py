"""The actor's loss: PPO, GSPO or CISPO from the loss registry, plus entropy and KL terms.

`make_policy_loss` weights the per-token loss by the rollout correction's IS weights when on,
aggregates it, subtracts entropy_coeff * entropy and adds kl_loss_coef * KL(pi || pi_ref), all over
the global counts (engines/training/base.py's contract).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
from tensordict import TensorDict

from engines.training.base import GlobalCounts, LossFn
from schema.losses import PolicyLossConfig, RolloutCorrectionConfig
from workers.losses.aggregation import aggregate, check_agg_mode, token_fraction, token_mean
from workers.losses.kl import MAX_LOG_RATIO, kl_estimate
from workers.losses.registry import TokenInputs, TokenLoss, objective
from workers.losses.rollout_correction import is_weights, mismatch_metrics


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
        weights, weight_metrics = is_weights(
            old_log_probs, rollout_log_probs, mask, correction.is_weights, correction.is_cap, counts
        )
        token_loss = token_loss * weights.to(token_loss.dtype)
        metrics.update(weight_metrics)
    return token_loss, metrics


def _masked_abs_max(values: torch.Tensor, mask: torch.Tensor) -> float:
    picked = values.detach()[mask.bool()]
    return float(picked.abs().max()) if picked.numel() else 0.0


TokenObjective = Callable[[TokenInputs], TokenLoss]


def make_token_objective(cfg: PolicyLossConfig) -> TokenObjective:
    """The registered objective of `cfg.policy_loss` (registry.py), with the job's clip ranges bound."""
    bounds = {
        "low": 1.0 - cfg.clip_ratio_low,
        "high": 1.0 + cfg.clip_ratio_high,
        "max_log_ratio": MAX_LOG_RATIO,
    }
    options = {"ppo": {**bounds, "dual_clip": cfg.clip_ratio_c}, "gspo": bounds, "cispo": bounds}
    if cfg.policy_loss not in options:
        raise ValueError(f"unknown policy_loss {cfg.policy_loss!r}; choose one of {', '.join(options)}")
    return partial(objective(cfg.policy_loss), **options[cfg.policy_loss])


def make_policy_loss(cfg: PolicyLossConfig) -> LossFn:
    """The actor's LossFn: reads response_mask, old_log_probs, advantages (ref_log_probs with
    use_kl_loss, rollout_log_probs when present) and outputs log_probs (and entropy)."""
    token_objective = make_token_objective(cfg)
    check_agg_mode(cfg.loss_agg_mode)  # fail at construction, not at the first micro-batch

    def policy_loss(
        micro_batch: TensorDict, outputs: dict[str, torch.Tensor], counts: GlobalCounts
    ) -> tuple[torch.Tensor, dict[str, float]]:
        mask = micro_batch["response_mask"]
        log_probs, old_log_probs = outputs["log_probs"], micro_batch["old_log_probs"]
        terms = token_objective(TokenInputs(log_probs, old_log_probs, micro_batch["advantages"], mask))
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

    Every objective is the advantage times a per-token factor, so a row of all-zero advantages adds
    nothing; the entropy and KL terms do not vanish with it.
    """
    if cfg.entropy_coeff != 0 or cfg.use_kl_loss:
        return None
    mask = micro_batch["response_mask"].bool()
    return (micro_batch["advantages"].ne(0) & mask).any(dim=-1)
