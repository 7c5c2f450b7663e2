"""`optim`, `algorithm` and `trainer`: how a job learns and how its loop runs.

The fields a lower layer also reads are declared there and inherited: the optimizer's and the
micro-batches' (schema/engine.py), the loss's (schema/losses.py), async RL's (schema/async_rl.py).
`policy_loss_config`, `update_schedule`, ... hand those layers their own models; `optim` is the
engine's OptimizerConfig itself.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator

from schema.async_rl import AsyncOptions
from schema.engine import (
    CollectiveTimeout,
    MicroBatchConfig,
    OptimizerConfig,
    ScheduleKind,
    SchedulerConfig,
    WarmupDecay,
)
from schema.losses import PolicyLossConfig
from schema.section import MAX_SAMPLES, Section, at_submission, field_error, fields_of
from schema.workers import UpdateSchedule

Tracker = Literal["tensorboard", "wandb", "mlflow"]


class OptimSpec(Section, OptimizerConfig, WarmupDecay):
    """The actor's optimizer (OptimizerConfig) and learning-rate schedule."""

    schedule: ScheduleKind = Field(
        "constant", description="constant lr after warmup, or cosine decay to min_lr_ratio x lr"
    )

    def scheduler_config(self, total_steps: int) -> SchedulerConfig:
        return fields_of(self, SchedulerConfig, kind=self.schedule, total_steps=total_steps)


class OverlongSpec(Section):
    """Responses cut off by their token budget (controller/step_math.py): rollout.max_new_tokens, or
    for a multi-turn trajectory rollout.max_response_tokens."""

    filter: bool = Field(
        False,
        description="exclude from the loss the responses whose generation stopped at the budget "
        "(finish reason 'length'; multi-turn: 'budget' or 'max_turns'); they still count in their "
        "group's baseline",
    )
    penalty_buffer: int = Field(
        0,
        ge=0,
        description="soft over-long punishment (DAPO): over the last penalty_buffer tokens of the budget "
        "(rollout.max_new_tokens; multi-turn: rollout.max_response_tokens) the reward falls linearly "
        "from 0 to -penalty_factor; 0 = off",
    )
    penalty_factor: float = Field(
        1.0, ge=0, description="the penalty of a response that uses the whole budget"
    )


class DynamicSamplingSpec(Section):
    """DAPO dynamic sampling (controller/batch_source.py)."""

    enabled: bool = Field(
        False,
        description="drop the groups whose rollout.n samples all got the same score, after the "
        "over-long penalty (no signal for group-relative advantages), and generate for more prompts "
        "until the step has trainer.prompts_per_step groups with signal",
    )
    max_rounds: int = Field(
        4,
        ge=1,
        description="generation rounds per step at most, the first included, each of "
        "trainer.prompts_per_step prompts; when they do not fill the batch, it is topped up with "
        "dropped groups (whose advantages are zero) and dynamic_sampling/groups_padded counts them",
    )


class AlgorithmSpec(Section, PolicyLossConfig, MicroBatchConfig):
    """Advantages, losses (PolicyLossConfig, rollout_correction included) and the PPO update's
    mini-batches, epochs and micro-batches (MicroBatchConfig)."""

    advantage: Literal["gae", "grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline"] | None = Field(
        None, description="defaults from the method"
    )
    norm_adv_by_std: bool = Field(True, description="GRPO: divide by the group std (False = Dr.GRPO)")
    gamma: float = Field(1.0, ge=0, le=1, description="GAE discount per token")
    lam: float = Field(
        1.0, ge=0, le=1, description="GAE lambda: bias (0) against variance (1) of the advantages"
    )
    kl_in_reward: bool = Field(
        False, description="subtract kl_reward_coef x KL(policy || reference) from the token rewards"
    )
    kl_reward_coef: float = Field(
        0.001, ge=0, le=1e6, description="weight of the in-reward KL penalty (kl_in_reward)"
    )
    kl_target: float | None = Field(
        None, gt=0, description="adaptive KL-in-reward: the target KL; None = fixed"
    )
    ppo_mini_batch_size: int | None = Field(
        None, gt=0, le=MAX_SAMPLES, description="samples per optimizer step; None = all"
    )
    ppo_epochs: int = Field(1, ge=1, le=1000, description="passes over a step's batch in the update")
    critic_lr: float = Field(1e-5, gt=0, le=10, description="the critic's learning rate (PPO)")
    recompute_old_log_probs: bool = Field(
        False,
        description="always run a separate forward pass for old log-probs; by default it is skipped when the "
        "update is one on-policy step (one mini-batch, one epoch, no KL in the reward), where it is exactly "
        "the current policy's",
    )
    vf_clip: float = Field(0.2, ge=0, le=1e6, description="value-loss clip range around the old values (PPO)")
    overlong: OverlongSpec = Field(
        default_factory=OverlongSpec, description="filtering and soft punishment of over-long responses"
    )
    dynamic_sampling: DynamicSamplingSpec = Field(
        default_factory=DynamicSamplingSpec, description="DAPO dynamic sampling of signal-bearing groups"
    )

    def policy_loss_config(self) -> PolicyLossConfig:
        return fields_of(self, PolicyLossConfig)

    def micro_batch_config(self) -> MicroBatchConfig:
        return fields_of(self, MicroBatchConfig)

    def update_schedule(self, seed: int) -> UpdateSchedule:
        """The mini-batches and epochs of one update, the row order seeded by `seed` (the step)."""
        return UpdateSchedule(mini_batch_size=self.ppo_mini_batch_size, epochs=self.ppo_epochs, seed=seed)


class TrainerSpec(Section, AsyncOptions, CollectiveTimeout):
    """The loop: steps, validation, trackers, restarts, and sync or async RL (AsyncOptions)."""

    total_steps: int = Field(20, gt=0, le=100_000_000, description="training steps of the job")
    prompts_per_step: int = Field(
        16, gt=0, le=MAX_SAMPLES, description="prompts a step (RL: x rollout.n samples), or pairs (SFT)"
    )
    epochs: int = Field(
        1,
        description="must be 1 (older specs carry it): a job passes over its data as many times as "
        "trainer.total_steps x prompts_per_step rows need, in a new order each pass",
    )
    val_every: int = Field(5, ge=0, le=100_000_000, description="0 disables validation")
    val_size: int = Field(64, gt=0, le=MAX_SAMPLES, description="validation prompts per evaluation")
    val_greedy: bool = Field(
        True,
        description="validation answers greedily; False: sampled at rollout.temperature with a fixed seed "
        "(the same random numbers every validation and every job: val/score/mean estimates the policy's "
        "expected reward, smoother than a small model's greedy answer, which flips)",
    )
    stop_at_val_accuracy: float | None = Field(
        None,
        gt=0,
        le=1,
        description="end the job early, with its checkpoint and export, at the first validation whose "
        "accuracy reaches this (e.g. an SFT warm start to a modest accuracy); None = run total_steps",
    )
    seed: int = Field(0, ge=0, lt=2**32, description="seeds numpy too, whose seeds are 32-bit")
    samples_per_step: int = Field(
        4, ge=0, le=64, description="trajectories stored per step for the samples view; 0 = none"
    )
    loggers: list[Tracker] = Field(
        default_factory=list,
        max_length=3,
        description="experiment trackers that also receive every step's metrics, hyper-parameter changes "
        "and samples, off the step's critical path (controller/trackers.py): any of tensorboard (event files "
        "in the job's folder), wandb (online when logged in, else offline in the job's folder), mlflow",
    )
    tracker_project: str = Field(
        "tandem", min_length=1, max_length=128, description="the W&B project and MLflow experiment of the run"
    )
    mlflow_uri: str | None = Field(
        None,
        min_length=1,
        max_length=2048,
        description="MLflow tracking URI (a server, or a local folder); default $MLFLOW_TRACKING_URI, "
        "else mlruns/ in the job's folder",
    )
    max_restarts: int = Field(
        3,
        ge=0,
        le=1000,
        description="times the job restarts its workers from its last checkpoint after a worker dies (process "
        "gone, node lost, a call timed out); an error in the job's own code is never retried; 0 = fail at once",
    )
    call_timeout_s: float = Field(
        3600.0,
        ge=1,
        le=3600,
        description="seconds any call on the job's worker groups may take once they have started (a "
        "generation, log-probs, an update, a weight sync, a reward model's scores, a checkpoint's save, load "
        "or export: set it above the slowest of them); a worker that has not answered by then is named (rank, "
        "pid, node, the call) and handled as a dead worker: the job restarts from its last checkpoint, or a "
        "split rollout worker is replaced alone (trainer.max_restarts). Set, it must exceed "
        "trainer.collective_timeout_s, which bounds the collectives inside a call",
    )
    restart_backoff_s: float = Field(
        5.0, ge=0, le=3600, description="seconds before the first restart, doubled for each further one"
    )
    restart_wait_s: float = Field(
        600.0,
        gt=0,
        le=7 * 86400,
        description="how long a restart waits for the cluster to have room for the job's workers again",
    )

    @field_validator("epochs")
    @classmethod
    def _no_pass_count(cls, value: int, info: ValidationInfo) -> int:
        if value != 1 and at_submission(info):  # nothing reads it: an accepted count would be ignored
            raise ValueError("passes over the data are not counted: they follow from trainer.total_steps x "
                             "prompts_per_step; set trainer.total_steps (and leave epochs at 1)")  # fmt: skip
        return value

    @model_validator(mode="after")
    def _calls_outlast_collectives(self, info: ValidationInfo) -> TrainerSpec:
        # A call that ends first would name every rank of a collective silent, not the hung one.
        given = "call_timeout_s" in self.model_fields_set  # the default leaves a longer collective as it was
        if given and self.call_timeout_s <= self.collective_timeout_s and at_submission(info):
            raise field_error(("call_timeout_s",), f"trainer.call_timeout_s ({self.call_timeout_s:g}s) must "
                              f"exceed trainer.collective_timeout_s ({self.collective_timeout_s:g}s), which "
                              "bounds the collectives inside a call: raise the first or lower the second",
                              self.call_timeout_s, named=False)  # fmt: skip
        return self

    @model_validator(mode="after")
    def _target_needs_validation(self) -> TrainerSpec:
        if self.stop_at_val_accuracy is not None and not self.val_every:
            raise field_error(("stop_at_val_accuracy",), "trainer.stop_at_val_accuracy needs validation: set "
                              "trainer.val_every > 0", self.stop_at_val_accuracy, named=False)  # fmt: skip
        return self
