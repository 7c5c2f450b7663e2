"""The off-policy correction of an async job (trainer.off_policy_correction): the loss settings it
implies, whether a step runs the proximal pass, and behaviour_ppo's batch.

pi_behav: the rollout engine's log-probs; pi_prox: the trainer's before the update; pi_theta: the
policy being updated; C = algorithm.rollout_correction.is_cap; clip(r) = clip(r, 1 - eps_low, 1 + eps_high).
"""

from __future__ import annotations

from typing import Any

from schema.job import JobSpec
from workers.batch import Batch


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
