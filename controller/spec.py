"""JobSpec: everything a job is, as one validated model.

The REST payload, the YAML/JSON example files and the CLI flags are this same model. Every section
forbids unknown keys, so a typo is a 422 that names the field, and the defaults run on a laptop: a
GRPO job on the built-in arithmetic task with a ~1M-parameter model, on CPU.

A setting that a lower layer also uses is declared once, in that layer's model, and inherited here:
`optim` from engines.config.OptimizerConfig / WarmupDecay, `algorithm` from
workers.loss_config.PolicyLossConfig and engines.config.MicroBatchConfig, `rollout` from
workers.config.RolloutOptions / EnvironmentOptions and engines.rollout.SamplingKnobs. Their validators run on submission,
and the section methods (`optimizer_config`, `policy_loss_config`, `sampling_params`, ...) hand the
lower layers their own model, typed. See docs/ARCHITECTURE.md, "Configuration".
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import (
    Field,
    StringConstraints,
    field_validator,
    model_validator,
)

from controller.async_config import AsyncOptions, check_async
from controller.external_spec import ExternalSpec
from controller.reasoning_gym_spec import ReasoningGymSpec, check_data_source, check_reward
from controller.spec_resources import ResourcesSpec
from controller.spec_section import Section, deep_merge, field_error
from engines.config import (
    Dtype,
    LoraConfig,
    MicroBatchConfig,
    OptimizerConfig,
    ScheduleKind,
    SchedulerConfig,
    WarmupDecay,
    fields_of,
)
from engines.rollout.base import SamplingKnobs, SamplingParams
from workers.config import EnvironmentConfig, EnvironmentOptions, RolloutOptions, UpdateSchedule
from workers.loss_config import PolicyLossConfig

MAX_SAMPLES = 1 << 20  # prompts, samples or rows per step: far beyond any machine's memory

Method = Literal["sft", "grpo", "ppo", "rloo", "reinforce_pp", "reinforce_pp_baseline"]
Tracker = Literal["tensorboard", "wandb", "mlflow"]


# A metadata key: what `?metadata=key:value` can name (no ':', which ends the key there).
METADATA_KEY = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-/]*")
Tag = Annotated[str, StringConstraints(strip_whitespace=True, min_length=1, max_length=64)]
JobName = Annotated[str, StringConstraints(strip_whitespace=True, min_length=1, max_length=200)]
Notes = Annotated[str, StringConstraints(max_length=10_000)]


class JobLabels(Section):
    """What a person calls a job and finds it by; set at submission, changed with PATCH /v1/jobs/{id}."""

    name: JobName | None = Field(None, description="a short human name; need not be unique")
    tags: list[Tag] = Field(default_factory=list, max_length=32, description="labels to filter by (?tag=)")
    notes: Notes = Field("", description="free text: why the job exists, what was seen")


class ModelSpec(Section):
    """The policy model: a local HF folder, or a built-in tiny model built on demand."""

    path: str | None = Field(
        None, description="local Hugging Face folder (config.json, tokenizer, safetensors)"
    )
    builtin: str | None = Field(None, description="name of a built-in model, e.g. 'qwen2-1m'")
    critic_path: str | None = Field(None, description="critic body (PPO); defaults to the policy's folder")
    dtype: Dtype = Field(
        "auto",
        description="auto: bf16 on GPU, fp32 on CPU; the trainer's and the rollout's. bfloat16 on a CPU: "
        "the trainer's linear layers multiply in bf16 (3-4x fp32's rate on a CPU with AMX) over fp32 weights",
    )
    gradient_checkpointing: bool = Field(
        False, description="recompute activations in backward: less memory, more compute"
    )
    lora: LoraConfig | None = Field(
        None,
        description="train low-rank adapters (LoRA) over the frozen model instead of all its weights; "
        "give it about 10x a full fine-tune's optim.lr (docs/guides/lora.md)",
    )

    @model_validator(mode="after")
    def _one_source(self) -> ModelSpec:
        if (self.path is None) == (self.builtin is None):
            field = "path" if self.path is not None else "builtin"
            raise field_error(
                (field,), "give exactly one of model.path or model.builtin", self.path, named=False
            )
        return self


class DataSpec(Section):
    """Prompt data (RL) or prompt/response pairs (SFT), from local JSONL or Parquet files."""

    train_path: str | None = Field(None, description="JSONL or Parquet; None with builtin_task")
    val_path: str | None = Field(
        None, description="held-out rows for validation (JSONL or Parquet); default: a split of the task"
    )
    builtin_task: str | None = Field("arithmetic", description="generate a built-in task's data instead")
    prompt_key: str = Field("prompt", description="the column holding the prompt (text or chat messages)")
    response_key: str = Field("response", description="SFT only")
    ground_truth_key: str = Field(
        "ground_truth", description="the column passed to the reward as ground_truth"
    )
    extra_key: str | None = Field(
        "extra", description="the column passed to the reward as extra (a dict); None = none"
    )
    max_prompt_length: int = Field(
        64, gt=0, le=1_048_576, description="longer prompts are dropped and counted"
    )
    shuffle: bool = Field(True, description="visit the training rows in a seeded random order each epoch")
    reasoning_gym: ReasoningGymSpec | None = Field(None, description="generate reasoning-gym task rows")

    @model_validator(mode="after")
    def _one_source(self) -> DataSpec:
        if self.train_path is None and self.builtin_task is None:
            raise field_error(("train_path",), "give data.train_path or data.builtin_task", None, named=False)
        check_data_source(self)
        return self


class RewardSpec(Section):
    """A rule reward ('builtin:NAME', 'module:function' or 'path/file.py:function') or a reward model."""

    function: str | None = Field("builtin:arithmetic", description="rule reward function")
    model_path: str | None = Field(None, description="sequence-classification reward model folder")
    num_workers: int = Field(0, ge=0, le=256, description="processes for rule rewards; 0 = in the controller")

    @model_validator(mode="after")
    def _one_source(self) -> RewardSpec:
        if (self.function is None) == (self.model_path is None):
            field = "model_path" if self.model_path is not None else "function"
            raise field_error(
                (field,), "give exactly one of reward.function or reward.model_path", None, named=False
            )
        return self


class RolloutSpec(Section, RolloutOptions, SamplingKnobs, EnvironmentOptions):
    """Generation: backend and memory behaviour in the colocated worker (workers.config.RolloutOptions),
    sampling (engines.rollout.SamplingKnobs), multi-turn environments (workers.config.EnvironmentOptions),
    and the group size and response length of the job."""

    n: int = Field(8, ge=1, le=4096, description="samples per prompt (the GRPO group size)")
    max_new_tokens: int = Field(
        8, gt=0, le=1_048_576, description="hard cap on generated tokens per response"
    )
    source: Literal["prompts", "external"] = Field(
        "prompts",
        description="prompts: the job samples its data's prompts; external: agents call the job's "
        "OpenAI-compatible endpoint and report rewards (rollout.external)",
    )
    external: ExternalSpec | None = Field(None, description="a job fed by agents (rollout.source external)")

    @model_validator(mode="after")
    def _external_source(self) -> RolloutSpec:
        if self.source != "external" and self.external is not None:
            raise field_error(("external",), "needs rollout.source: external", None, named=False)
        if self.source == "external" and self.environment is not None:
            raise field_error(("environment",), "rollout.source external runs no environment: remove it",
                              self.environment, named=False)  # fmt: skip
        return self

    @property
    def external_config(self) -> ExternalSpec | None:
        """The external source's settings (its defaults when rollout.external is not given)."""
        return None if self.source != "external" else self.external or ExternalSpec()

    @property
    def response_budget_field(self) -> str:
        """The field that bounds a sample's tokens after its first prompt: a multi-turn trajectory's
        max_response_tokens (all its turns and the observations between them), else max_new_tokens."""
        return "max_response_tokens" if self.environment is not None else "max_new_tokens"

    @property
    def response_budget(self) -> int:
        """The value of `response_budget_field` (over-long handling and the length clip ratio use it)."""
        return getattr(self, self.response_budget_field)

    def environment_config(self) -> EnvironmentConfig | None:
        """The multi-turn settings the workers run with; None for single-turn generation."""
        return None if self.environment is None else fields_of(self, EnvironmentConfig)

    def sampling_params(self, seed: int | None, greedy: bool = False) -> SamplingParams:
        """One completion per (already repeated) prompt, with this section's settings."""
        overrides: dict[str, Any] = {"temperature": 0.0} if greedy else {}
        return fields_of(self, SamplingParams, n=1, seed=seed, **overrides)


class OptimSpec(Section, OptimizerConfig, WarmupDecay):
    """The actor's optimizer (engines.config.OptimizerConfig) and learning-rate schedule."""

    schedule: ScheduleKind = Field(
        "constant", description="constant lr after warmup, or cosine decay to min_lr_ratio x lr"
    )

    def optimizer_config(self, lr: float) -> OptimizerConfig:
        return fields_of(self, OptimizerConfig, lr=lr)

    def scheduler_config(self, total_steps: int) -> SchedulerConfig:
        return fields_of(self, SchedulerConfig, kind=self.schedule, total_steps=total_steps)


class OverlongSpec(Section):
    """Responses cut off by their token budget (controller/overlong.py): rollout.max_new_tokens, or
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
    """DAPO dynamic sampling (controller/dynamic_sampling.py)."""

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
    """Advantages, losses (workers.loss_config.PolicyLossConfig, rollout_correction included) and the PPO update's mini-batches, epochs
    and micro-batches (engines.config.MicroBatchConfig)."""

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


class TrainerSpec(Section, AsyncOptions):
    """The loop: steps, validation, trackers, restarts, and sync or async RL (controller.async_config)."""

    total_steps: int = Field(20, gt=0, le=100_000_000, description="training steps of the job")
    prompts_per_step: int = Field(
        16, gt=0, le=MAX_SAMPLES, description="prompts a step (RL: x rollout.n samples), or pairs (SFT)"
    )
    epochs: int = Field(1, ge=1, le=100_000, description="SFT: passes over the data")
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
        "and samples, off the step's critical path (controller/trackers/): any of tensorboard (event files "
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
    restart_backoff_s: float = Field(
        5.0, ge=0, le=3600, description="seconds before the first restart, doubled for each further one"
    )
    restart_wait_s: float = Field(
        600.0,
        gt=0,
        le=7 * 86400,
        description="how long a restart waits for the cluster to have room for the job's workers again",
    )

    @model_validator(mode="after")
    def _target_needs_validation(self) -> TrainerSpec:
        if self.stop_at_val_accuracy is not None and not self.val_every:
            raise field_error(("stop_at_val_accuracy",), "trainer.stop_at_val_accuracy needs validation: set "
                              "trainer.val_every > 0", self.stop_at_val_accuracy, named=False)  # fmt: skip
        return self


class CheckpointSpec(Section):
    every: int = Field(5, ge=0, le=100_000_000, description="steps between checkpoints; 0 = only at the end")
    keep_last: int = Field(2, ge=1, le=10_000, description="checkpoints kept; older ones are deleted")
    export_hf: bool = Field(
        True, description="write an HF folder of the final policy (with model.lora: a PEFT adapter folder)"
    )
    export_merged: bool = Field(
        False, description="with model.lora: also write the base with the adapters merged in, export/merged"
    )
    resume_from: str | None = Field(None, description="a checkpoint folder to start from")


class JobSpec(JobLabels):
    """One job: what to train, on what, how, on which resources (and, from JobLabels, its name, tags
    and notes)."""

    method: Method = Field(
        "grpo", description="sft, or the RL algorithm (its advantage estimator and loss defaults)"
    )
    model: ModelSpec = Field(default_factory=lambda: ModelSpec(builtin="qwen2-1m"))
    data: DataSpec = Field(default_factory=DataSpec)
    reward: RewardSpec = Field(default_factory=RewardSpec)
    rollout: RolloutSpec = Field(default_factory=RolloutSpec)
    optim: OptimSpec = Field(default_factory=OptimSpec)
    algorithm: AlgorithmSpec = Field(default_factory=AlgorithmSpec)
    trainer: TrainerSpec = Field(default_factory=TrainerSpec)
    checkpoint: CheckpointSpec = Field(default_factory=CheckpointSpec)
    resources: ResourcesSpec = Field(default_factory=ResourcesSpec)
    metadata: dict[str, str] = Field(
        default_factory=dict,
        description="free key/value labels (filter with ?metadata=key:value); a key is letters, digits "
        "and _ . - /, not starting with . - or /",
    )

    @field_validator("metadata")
    @classmethod
    def _metadata_keys(cls, value: dict[str, str]) -> dict[str, str]:
        for key in value:
            if not METADATA_KEY.fullmatch(key):
                raise ValueError(
                    f"key '{key[:64]}' must be letters, digits and _ . - /, not starting with . - /"
                )
        return value

    @model_validator(mode="after")
    def _consistent(self) -> JobSpec:
        if self.method == "ppo" and self.algorithm.advantage not in (None, "gae"):
            raise field_error(("algorithm", "advantage"), "method 'ppo' uses GAE: leave it unset or 'gae'",
                              self.algorithm.advantage)  # fmt: skip
        rollout_workers = self.resources.rollout_workers
        if rollout_workers is None and self.resources.workers % self.rollout.tensor_parallel_size:
            raise field_error(("resources", "workers"), "resources.workers must be a multiple of "
                              "rollout.tensor_parallel_size", self.resources.workers, named=False)  # fmt: skip
        if rollout_workers is not None and rollout_workers.workers % self.rollout.tensor_parallel_size:
            raise field_error(("resources", "rollout", "workers"), "resources.rollout.workers must be a multiple "
                              "of rollout.tensor_parallel_size", rollout_workers.workers, named=False)  # fmt: skip
        # Every rank must get the same number of real samples: padded rows would be trained on.
        samples = self.trainer.prompts_per_step * (1 if self.method == "sft" else self.rollout.n)
        if self.rollout.external_config is not None:
            if self.method == "sft":
                raise field_error(("rollout", "source"), "external feeds RL jobs: use an RL method, not sft",
                                  self.rollout.source)  # fmt: skip
            samples = self.rollout.external_config.trajectories_per_step
        # The field that sets the step's samples: an external job's trajectories, else the prompts.
        at = (
            ("rollout", "external", "trajectories_per_step")
            if self.rollout.external_config
            else ("trainer", "prompts_per_step")
        )
        if samples > MAX_SAMPLES:
            raise field_error(at, f"trainer.prompts_per_step x rollout.n = {samples} samples per step; at most "
                              f"{MAX_SAMPLES} are allowed", samples, named=False)  # fmt: skip
        if samples % self.resources.workers:
            raise field_error(at,
                f"trainer.prompts_per_step x rollout.n = {samples} samples per step must be a multiple of "
                f"resources.workers = {self.resources.workers}", samples, named=False
            )  # fmt: skip
        mini = self.algorithm.ppo_mini_batch_size
        if mini is not None and (samples % mini or mini % self.resources.workers):
            raise field_error(("algorithm", "ppo_mini_batch_size"),
                f"algorithm.ppo_mini_batch_size = {mini} must divide the {samples} samples of a step and be a "
                f"multiple of resources.workers = {self.resources.workers}", mini, named=False
            )  # fmt: skip
        self._check_overlong_and_dynamic_sampling()
        check_async(self, samples)
        check_reward(self)
        return self

    def _check_overlong_and_dynamic_sampling(self) -> None:
        buffer = self.algorithm.overlong.penalty_buffer
        if buffer > self.rollout.response_budget:
            raise field_error(("algorithm", "overlong", "penalty_buffer"),
                f"algorithm.overlong.penalty_buffer = {buffer} must not exceed "
                f"rollout.{self.rollout.response_budget_field} = {self.rollout.response_budget}", buffer, named=False
            )  # fmt: skip
        if self.algorithm.dynamic_sampling.enabled and (self.method == "sft" or self.rollout.n < 2):
            raise field_error(("algorithm", "dynamic_sampling", "enabled"), "algorithm.dynamic_sampling needs "
                              "groups: an RL method with rollout.n >= 2", True, named=False)  # fmt: skip

    @property
    def advantage_estimator(self) -> str:
        """The estimator this job uses: explicit, else implied by the method."""
        if self.algorithm.advantage:
            return self.algorithm.advantage
        return {"ppo": "gae", "grpo": "grpo", "rloo": "rloo"}.get(self.method, self.method)

    def merged(self, overrides: dict[str, Any]) -> JobSpec:
        """A new spec with nested overrides applied (fork), validated as a whole."""
        return JobSpec.model_validate(deep_merge(self.model_dump(), overrides))
