"""Settings that a job's path never reads, refused at submission when they differ from their default.

An async knob in a sync job, a critic's folder where no critic trains, a KL target without the KL
penalty it adapts: accepted, each would be silently ignored. `check_unread` names the first such
field in a 422 and says what would read it. Torch-free, like the whole schema package.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pydantic import BaseModel

from schema.section import field_error

if TYPE_CHECKING:
    from schema.job import JobSpec

# What an SFT step reads of `algorithm`: the loss's aggregation and the update's batches.
SFT_ALGORITHM = {"loss_agg_mode", "micro_batch_size", "max_tokens_per_micro_batch", "ppo_mini_batch_size",
                 "ppo_epochs"}  # fmt: skip
ASYNC_ONLY = ("max_staleness", "buffer_size", "partial_rollouts", "off_policy_correction", "rollout_lanes")
AGENTS = "rollout.source external: agents' rewarded trajectories make the step (rollout.external)"
MULTI_TURN_ONLY = ("max_turns", "max_response_tokens", "env_step_timeout_s")


def _changed(section: BaseModel, names: tuple[str, ...]) -> list[str]:
    """The fields among `names` whose value is not their default."""
    fields = type(section).model_fields
    return [n for n in names if getattr(section, n) != fields[n].get_default(call_default_factory=True)]


def _unread(spec: JobSpec) -> list[tuple[str, tuple[str, ...], str]]:
    """(section, fields this spec does not read, why) for each rule."""
    a, t, sft = spec.algorithm, spec.trainer, spec.method == "sft"
    critic = not sft and spec.advantage_estimator == "gae"
    external = spec.rollout.source == "external"
    rl_only = tuple(n for n in type(a).model_fields if n not in SFT_ALGORITHM)
    return [
        ("algorithm", rl_only if sft else (), "method sft trains on the pairs' cross-entropy alone"),
        ("model", () if critic else ("critic_path",), "only GAE advantages (method ppo, or algorithm.advantage gae) train a critic"),
        ("algorithm", () if critic else ("critic_lr", "vf_clip"), "only GAE advantages (method ppo, or algorithm.advantage gae) train a critic"),
        ("algorithm", () if spec.advantage_estimator == "grpo" else ("norm_adv_by_std",), "only GRPO advantages divide by the group std"),
        ("algorithm", () if critic else ("lam",), "only GAE advantages (method ppo, or algorithm.advantage gae) read it"),
        ("algorithm", () if critic or spec.advantage_estimator == "reinforce_pp" else ("gamma",),
         "only GAE and REINFORCE++ advantages discount"),
        ("algorithm", ("dynamic_sampling",) if external else (), AGENTS),
        ("rollout", ("n",) if external else (), AGENTS),
        ("trainer", ("prompts_per_step",) if external else (), AGENTS),
        ("algorithm", () if a.kl_in_reward else ("kl_reward_coef", "kl_target"), "needs algorithm.kl_in_reward"),
        ("algorithm", () if a.use_kl_loss else ("kl_loss_coef",), "needs algorithm.use_kl_loss"),
        ("trainer", () if t.mode == "async" else ASYNC_ONLY, "needs trainer.mode 'async'"),
        ("trainer", () if t.partial_rollouts else ("segment_tokens",), "needs trainer.partial_rollouts"),
        ("rollout", () if spec.rollout.environment else MULTI_TURN_ONLY, "multi-turn: needs rollout.environment"),
        ("checkpoint", () if spec.model.lora and spec.checkpoint.export_hf else ("export_merged",),
         "merges model.lora's adapters into the export: needs model.lora and checkpoint.export_hf"),
        ("reward", () if spec.reward.function else ("num_workers",), "runs rule rewards; reward.model_path scores"),
        ("trainer", () if "mlflow" in t.loggers else ("mlflow_uri",), "needs 'mlflow' in trainer.loggers"),
        ("trainer", () if {"wandb", "mlflow"} & set(t.loggers) else ("tracker_project",),
         "names the run's W&B project and MLflow experiment: needs 'wandb' or 'mlflow' in trainer.loggers"),
    ]  # fmt: skip


def check_unread(spec: JobSpec) -> None:
    """A value other than the default in a field this spec's path never reads is a 422 naming it."""
    for section, names, why in _unread(spec):
        for name in _changed(getattr(spec, section), names):
            value = getattr(getattr(spec, section), name)
            raise field_error((section, name), f"{why}; this job would ignore it: remove it", value)
