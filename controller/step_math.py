"""The controller-side arithmetic of one RL step: rewards into advantages, and the step's metrics.
Pure functions over Batches: the remote calls stay in controller/trainer.py.

Over-long responses (DAPO, Yu et al. 2025): a response that stopped at its token budget L_max
(`RolloutSpec.response_budget`) never finished its answer, so its reward says little about it.

    soft penalty   R_len(y) = -f * max(0, |y| - (L_max - L_c)) / L_c added to the score (buffer L_c)
    filter         truncated responses leave the loss (response mask 0); their scores still enter
                   their group's baseline

Scores first, then the filter: the penalty shapes what the advantages see, the filter what is trained.

A row whose reward function failed (raised, overran, returned no number) is not scored: `score` flags
it in the batch (`scored` False, its score a 0.0 placeholder), and `add_advantages` takes it out of the
advantages, its group's statistics and the loss (response mask 0; the engine's N_seqs leaves it out too),
so a failure neither trains nor moves its group's baseline. The step's score metrics and validation's
skip it. A multi-turn trajectory its environment failed comes flagged so (workers/multiturn.py).

The off-policy correction of an async job (trainer.off_policy_correction): pi_behav, the rollout
engine's log-probs; pi_prox, the trainer's before the update; pi_theta, the policy being updated;
C = algorithm.rollout_correction.is_cap; clip(r) = clip(r, 1 - eps_low, 1 + eps_high).
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import torch

from controller.advantages import apply_kl_penalty, compute_advantages, scores_to_token_rewards
from controller.rewards import RewardScorer
from engines.training.base import SCORED, GlobalCounts, loss_rows
from schema.job import JobSpec
from schema.losses import RolloutCorrectionConfig
from schema.training import OverlongSpec
from workers.batch import Batch
from workers.losses.rollout_correction import apply_rejection, mismatch_metrics

log = logging.getLogger("tandem.job")


def decode_responses(batch: Batch, tokenizer: Any) -> list[str]:
    """Each row's sampled tokens as text, in one `batch_decode` call (far faster than row by row)."""
    ids, keep = batch.tensors["responses"].tolist(), batch.tensors["response_mask"].bool().tolist()
    sampled = [
        [t for t, k in zip(row, flags, strict=True) if k] for row, flags in zip(ids, keep, strict=True)
    ]
    return tokenizer.batch_decode(sampled, skip_special_tokens=True)


def score(batch: Batch, scorer: RewardScorer, tokenizer: Any) -> tuple[torch.Tensor, dict[str, float]]:
    """Sequence scores [B] from the rule reward and its metrics; each row's error goes with the batch
    as `reward_error` (stored samples), the first few to the job's log, and whether it scored as
    SCORED."""
    texts = decode_responses(batch, tokenizer)
    extras = [e if isinstance(e, dict) else None for e in batch.non_tensors.get("extra", [None] * len(batch))]
    result = scorer.score(
        list(batch.non_tensors["prompt"]),
        texts,
        list(batch.non_tensors.get("ground_truth", [None] * len(batch))),
        extras,
    )
    batch.non_tensors["reward_error"] = np.array(result.row_errors or [None] * len(batch), dtype=object)
    batch.tensors[SCORED] = torch.tensor([e is None for e in batch.non_tensors["reward_error"]])
    if result.errors:
        log.warning("reward function %s failed on %d of %d samples (not trained on): %s", scorer.ref,
                    result.errors, len(batch), "; ".join(result.error_messages))  # fmt: skip
    return result.scores.float(), result.metrics


def with_tensors(batch: Batch, **tensors: torch.Tensor) -> Batch:
    out = batch.tensors.clone(recurse=False)
    for key, value in tensors.items():
        out[key] = value
    return Batch(out, batch.non_tensors, batch.meta)


def response_lengths(batch: Batch) -> torch.Tensor:
    """[B] generated tokens per sample: the attended response columns (the loss mask may be narrower)."""
    width = batch.tensors["response_mask"].shape[1]
    return batch.tensors["attention_mask"][:, -width:].sum(1)


def add_advantages(
    batch: Batch, scores: torch.Tensor, spec: JobSpec, kl_coef: float
) -> tuple[Batch, dict[str, float]]:
    """Token rewards (with the KL penalty when it is in the reward), then the job's estimator; rows not
    scored, and those the over-long filter keeps out, leave the loss (response mask 0)."""
    t, a = batch.tensors, spec.algorithm
    mask, scored = t["response_mask"], t.get(SCORED, None)
    rewards = scores_to_token_rewards(scores, mask)
    metrics: dict[str, float] = {}
    if a.kl_in_reward:
        rewards, batch_kl = apply_kl_penalty(
            rewards, t["old_log_probs"], t["ref_log_probs"], mask, kl_coef, a.kl_loss_type
        )
        metrics.update({"actor/reward_kl_penalty": batch_kl, "actor/reward_kl_penalty_coeff": kl_coef})
    advantages, returns = compute_advantages(
        spec.advantage_estimator,
        rewards,
        mask,
        values=t.get("values", None),
        uids=batch.non_tensors.get("uid"),
        gamma=a.gamma,
        lam=a.lam,
        norm_by_std=a.norm_adv_by_std,
        scored=scored,
    )
    for rows in (scored, t.get(OVERLONG_KEPT, None)):  # out of the loss now, after their group used them
        if rows is not None:
            mask = mask * rows.unsqueeze(1).to(mask.dtype)
    batch = with_tensors(
        batch, token_level_rewards=rewards, advantages=advantages, returns=returns, response_mask=mask
    )
    return batch, metrics


def reject_mismatched(batch: Batch, cfg: RolloutCorrectionConfig) -> tuple[Batch, dict[str, float]]:
    """The batch with the rollout correction's rejected tokens out of its loss mask, and the mismatch
    report over the tokens before rejection (the loss can only report on those it keeps)."""
    if cfg.rejection == "off":
        return batch, {}
    t = batch.tensors
    old, rollout, mask = t["old_log_probs"], t["rollout_log_probs"], t["response_mask"]
    kept, metrics = apply_rejection(mask, old, rollout, cfg)
    counts = GlobalCounts(int(mask.sum()), loss_rows(batch.tensors), mask.shape[1])
    metrics.update(mismatch_metrics(old, rollout, mask, counts))
    return with_tensors(batch, response_mask=kept), metrics


def _masked_stats(name: str, values: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    picked = values[mask.bool()]
    if picked.numel() == 0:
        return {}
    return {
        f"{name}/mean": float(picked.mean()),
        f"{name}/max": float(picked.max()),
        f"{name}/min": float(picked.min()),
    }


def batch_metrics(batch: Batch, scores: torch.Tensor, max_new_tokens: int) -> dict[str, float]:
    t = batch.tensors
    mask = t["response_mask"]
    lengths = response_lengths(batch).float()
    prompt_lengths = t["attention_mask"].sum(1).float() - lengths
    ones = torch.ones_like(scores, dtype=torch.bool)
    scored = t.get(SCORED, ones)  # a failed reward's 0.0 placeholder is no score
    metrics = {
        **_masked_stats("critic/score", scores, scored),
        **_masked_stats("critic/rewards", t["token_level_rewards"].sum(1), scored),
        **_masked_stats("critic/advantages", t["advantages"], mask),
        **_masked_stats("critic/returns", t["returns"], mask),
        **_masked_stats("response_length", lengths, ones),
        "response_length/clip_ratio": float((lengths >= max_new_tokens).float().mean()),
        # Rows without policy gradient (GRPO: a group that all scored the same).
        "critic/advantages/zero_rows": float(
            (t["advantages"].ne(0) & mask.bool()).any(1).logical_not().float().mean()
        ),
        "prompt_length/mean": float(prompt_lengths.mean()),
    }
    if "values" in t.keys():
        metrics.update(_masked_stats("critic/values", t["values"], mask))
    if "entropy" in t.keys() and mask.any():  # no token left (every reward failed): no mean, not NaN
        metrics["actor/rollout_entropy"] = float(t["entropy"][mask.bool()].mean())
    return metrics


def validation_metrics(batch: Batch, scores: torch.Tensor) -> dict[str, float]:
    """val/score/mean and val/accuracy (a score of 1 or more) over the rows that scored, none when no row
    did, and val/unscored: the rows whose reward function or environment failed."""
    scored = batch.tensors.get(SCORED, torch.ones_like(scores, dtype=torch.bool))
    kept = scores[scored]
    metrics = {"val/unscored": float(len(scores) - len(kept))}
    if len(kept):
        metrics.update(
            {"val/score/mean": float(kept.mean()), "val/accuracy": float((kept >= 1.0).float().mean())}
        )
    return metrics


def overlong_penalty(lengths: torch.Tensor, max_new_tokens: int, buffer: int, factor: float) -> torch.Tensor:
    """R_len of the module doc for each length [B]; zeros when the buffer is 0."""
    if buffer == 0:
        return torch.zeros(lengths.shape, dtype=torch.float32)
    excess = (lengths.float() - (max_new_tokens - buffer)).clamp(min=0)
    return -factor * excess / buffer


OVERLONG_KEPT = "overlong_kept"  # [B] bool: False for a row the over-long filter keeps out of the loss


def apply_overlong(
    batch: Batch, scores: torch.Tensor, cfg: OverlongSpec, max_new_tokens: int
) -> tuple[Batch, torch.Tensor, dict[str, float]]:
    """The penalised scores and the batch with the filter's rows flagged (OVERLONG_KEPT), with
    overlong/truncated_frac, masked_frac and penalty_mean; `max_new_tokens` is the samples' budget L_max."""
    t = batch.tensors
    metrics: dict[str, float] = {}
    if "truncated" in t.keys():
        metrics["overlong/truncated_frac"] = float(t["truncated"].float().mean())
    if cfg.penalty_buffer:
        penalty = overlong_penalty(
            response_lengths(batch), max_new_tokens, cfg.penalty_buffer, cfg.penalty_factor
        )
        scores = scores + penalty.to(scores.dtype)
        metrics["overlong/penalty_mean"] = float(penalty.mean())
    if cfg.filter:
        if "truncated" not in t.keys():
            raise KeyError("algorithm.overlong.filter needs the rollout's 'truncated' flags in the batch")
        batch = with_tensors(batch, **{OVERLONG_KEPT: t["truncated"] == 0})  # add_advantages masks them
        metrics["overlong/masked_frac"] = float(t["truncated"].float().mean())
    return batch, scores, metrics


def corrected_spec(spec: JobSpec) -> JobSpec:
    """The spec whose loss applies trainer.off_policy_correction, with r = pi_theta / pi_prox:

    decoupled      L = - min(pi_prox / pi_behav, C) * min(r A, clip(r) A)  (AReaL, Fu et al. 2025, eq. 5,
                   truncated rather than masked past the cap); needs pi_prox: recompute_old_log_probs.
    tis            the same with pi_prox = pi_theta.detach(): for one epoch an unclipped, truncated
                   importance-sampling loss (Yao et al. 2025).
    behaviour_ppo  L = - min(rho A, clip(rho) A), rho = pi_theta / pi_behav: PPO around whatever weights
                   sampled each token (AReaL's baseline); no behaviour weight, no proximal pass.
    none           the sync loss unchanged.

    decoupled is the default: its trust region is around the proximal policy and its weight truncated,
    where behaviour_ppo clips around stale weights. decoupled and tis use token-level TIS unless the
    user set another level."""
    choice = spec.trainer.off_policy_correction
    if spec.trainer.mode != "async" or choice in ("none", "behaviour_ppo"):
        return spec
    correction = spec.algorithm.rollout_correction
    level = correction.is_weights if correction.is_weights != "off" else "token"
    algorithm: dict[str, Any] = {"rollout_correction": {"is_weights": level}}
    if choice == "decoupled":
        algorithm["recompute_old_log_probs"] = True
    return spec.merged({"algorithm": algorithm})


def needs_old_log_probs(spec: JobSpec, samples: int, asked_proximal: bool) -> bool:
    """Whether the step runs the old (proximal) log-prob pass (`asked_proximal`: the user's setting).
    Not for a one-optimizer-step update (its first forward gives the same numbers) unless something
    reads them first (KL in the reward, rollout rejection)."""
    a, choice = spec.algorithm, spec.trainer.off_policy_correction
    rejection = a.rollout_correction.rejection != "off"
    single_step = a.ppo_epochs == 1 and a.ppo_mini_batch_size in (None, samples)
    if spec.trainer.mode == "async" and choice == "behaviour_ppo":
        return a.recompute_old_log_probs or a.kl_in_reward or rejection
    if spec.trainer.mode == "async" and choice == "decoupled" and not asked_proximal:
        return not single_step or a.kl_in_reward or rejection
    return a.recompute_old_log_probs or not single_step or a.kl_in_reward or rejection


def actor_inputs(spec: JobSpec, batch: Batch) -> Batch:
    """The batch the actor's loss reads: behaviour_ppo's has the behaviour log-probs as its old ones."""
    if spec.trainer.mode == "async" and spec.trainer.off_policy_correction == "behaviour_ppo":
        return behaviour_as_old(batch)
    return batch


def behaviour_as_old(batch: Batch) -> Batch:
    """old_log_probs = rollout_log_probs, and no rollout_log_probs left (no trivial mismatch report)."""
    if "rollout_log_probs" not in batch.tensors.keys():
        raise KeyError(
            "off_policy_correction behaviour_ppo needs the rollout engine's log-probs in the batch"
        )
    tensors = batch.tensors.clone(recurse=False)
    tensors["old_log_probs"] = tensors["rollout_log_probs"]
    del tensors["rollout_log_probs"]
    return Batch(tensors, batch.non_tensors, batch.meta)
