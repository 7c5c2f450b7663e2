"""The off-policy correction of an async job (trainer.off_policy_correction): the loss settings it
implies (`corrected_spec`), whether a step runs the proximal pass (`needs_old_log_probs`, sync's rule
too) and, for behaviour_ppo, the batch the loss reads (`actor_inputs`, `behaviour_as_old`).

Notation: pi_behav the rollout engine's log-probs (kept per token, the policy that sampled the
token), pi_prox the trainer's recomputed log-probs before the update, pi_theta the policy being
updated, C = algorithm.rollout_correction.is_cap, A the advantage, clip(r) = clip(r, 1 - eps_low,
1 + eps_high) (algorithm.clip_ratio_low / _high), token-mean unless loss_agg_mode says otherwise.
"""

from __future__ import annotations

from typing import Any

from schema.job import JobSpec
from workers.batch import Batch


def corrected_spec(spec: JobSpec) -> JobSpec:
    """The spec whose loss applies trainer.off_policy_correction, with r = pi_theta / pi_prox:

    decoupled      L = - min(pi_prox / pi_behav, C) * min(r A, clip(r) A)
                   Fu et al. 2025, "AReaL", eq. 5 (the decoupled PPO objective: the trust region is
                   around the proximal policy, the behaviour weight corrects the sampling); AReaL
                   masks tokens past the cap, this truncates them (Yao et al. 2025). Needs the
                   proximal log-probs: algorithm.recompute_old_log_probs is set (`needs_old_log_probs`
                   skips the pass when the update is one optimizer step: its first forward is pi_prox).
    tis            L = - min(pi_theta.detach() / pi_behav, C) * min(r A, clip(r) A) with pi_prox =
                   pi_theta.detach(): for one epoch r = 1, an unclipped, truncated importance-sampling
                   loss (Yao et al. 2025): with one update per batch the same gradient as
                   `decoupled` (the update's own forward gives the proximal log-probs), with more
                   mini-batches the trainer runs that pass for it too, and the two are the same loss.
    behaviour_ppo  L = - min(rho A, clip(rho) A), rho = pi_theta / pi_behav (dual clip as in sync PPO):
                   PPO with the behaviour policy as its old policy and no proximal pass, AReaL's
                   "PPO" baseline under staleness (Fu et al. 2025, section 5 / Figure 6, "decoupled
                   PPO" against plain PPO): the trust region is around whatever weights sampled each
                   token, k steps old. `behaviour_as_old` puts pi_behav in old_log_probs.
    none           the sync loss unchanged (samples treated as on-policy).

    decoupled is the default: its trust region is around the proximal policy and its weight is
    truncated, where behaviour_ppo clips around stale weights and an unclipped weight can explode.

    decoupled and tis use the token-level TIS of workers/losses/rollout_correction.py
    (`is_weights`); a level the user set ('sequence') is kept. behaviour_ppo has no behaviour weight
    (the spec rejects rollout_correction.is_weights with it: the weight would be 1)."""
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
    """Whether the step runs the old (proximal) log-prob pass before the update (`asked_proximal`: the
    user's algorithm.recompute_old_log_probs, before `corrected_spec`). Not when the update is one
    optimizer step (its first forward, detached, gives the same numbers) unless something reads them
    first (KL in the reward, rollout rejection); behaviour_ppo's old policy is the behaviour one."""
    a, choice = spec.algorithm, spec.trainer.off_policy_correction
    rejection = a.rollout_correction.rejection != "off"
    single_step = a.ppo_epochs == 1 and a.ppo_mini_batch_size in (None, samples)
    if spec.trainer.mode == "async" and choice == "behaviour_ppo":
        return a.recompute_old_log_probs or a.kl_in_reward or rejection
    if spec.trainer.mode == "async" and choice == "decoupled" and not asked_proximal:
        return not single_step or a.kl_in_reward or rejection
    return a.recompute_old_log_probs or not single_step or a.kl_in_reward or rejection


def actor_inputs(spec: JobSpec, batch: Batch) -> Batch:
    """The batch the actor's loss reads: behaviour_ppo's (an async job's) has the behaviour log-probs
    as its old ones; every other's is the batch as it is."""
    if spec.trainer.mode == "async" and spec.trainer.off_policy_correction == "behaviour_ppo":
        return behaviour_as_old(batch)
    return batch


def behaviour_as_old(batch: Batch) -> Batch:
    """behaviour_ppo's actor batch: old_log_probs = rollout_log_probs (pi_behav), and no
    rollout_log_probs left, so the loss reports no (trivially zero) engine mismatch against itself.
    Its PPO ratio's extremes are in actor/log_ratio_max and actor/pg_clipfrac."""
    if "rollout_log_probs" not in batch.tensors.keys():
        raise KeyError(
            "off_policy_correction behaviour_ppo needs the rollout engine's log-probs in the batch"
        )
    tensors = batch.tensors.clone(recurse=False)
    tensors["old_log_probs"] = tensors["rollout_log_probs"]
    del tensors["rollout_log_probs"]
    return Batch(tensors, batch.non_tensors, batch.meta)
