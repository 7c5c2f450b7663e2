"""JobSpec: everything a job is, as one validated model.

The REST payload, the YAML/JSON example files and the CLI flags are this same model. Every section
forbids unknown keys, so a typo is a 422 that names the field, and the defaults run on a laptop: a
GRPO job on the built-in arithmetic task with a ~1M-parameter model, on CPU.

The sections live beside it in this package: `rollout` (schema/rollout.py), `optim`, `algorithm`
and `trainer` (schema/training.py), `resources` (schema/resources.py). A setting that a lower layer
also uses is declared once, in that layer's model in this package, and inherited by its section, so
its validators run on submission and the section methods hand the lower layers their own model,
typed. See docs/ARCHITECTURE.md, "Configuration".
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import Field, StringConstraints, ValidationInfo, field_validator, model_validator

from engines.rollout import ROLLOUT_ENGINES
from schema.async_rl import check_async
from schema.engine import Dtype, LoraConfig
from schema.reasoning_gym import ReasoningGymSpec, check_data_source, check_reward
from schema.resources import ResourcesSpec
from schema.rollout import RolloutSpec
from schema.section import MAX_SAMPLES, Section, at_submission, deep_merge, field_error
from schema.training import AlgorithmSpec, OptimSpec, TrainerSpec
from schema.unread import check_unread

Method = Literal["sft", "grpo", "ppo", "rloo", "reinforce_pp", "reinforce_pp_baseline"]
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
        "the trainer's linear layers multiply in bf16 over fp32 weights",
    )
    gradient_checkpointing: bool = Field(
        False, description="recompute activations in backward: less memory, more compute"
    )
    lora: LoraConfig | None = Field(
        None,
        description="train low-rank adapters (LoRA) over the frozen model instead of all its weights; "
        "it wants a larger optim.lr than a full fine-tune (docs/guides/lora.md)",
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
    def _consistent(self, info: ValidationInfo) -> JobSpec:
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
        if (
            rollout_workers is not None
            and self.rollout.offload_trainer_during_rollout
            and at_submission(info)
        ):
            raise field_error(("rollout", "offload_trainer_during_rollout"), "frees the device of a trainer "
                              "that generates in its own process; with resources.placement 'split' the rollout "
                              "runs on workers of its own and the trainer has nothing to free: remove it", True)  # fmt: skip
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
        self._check_backend_limits()
        check_async(self, samples)
        check_reward(self)
        if at_submission(info):
            check_unread(self)
        return self

    def _check_backend_limits(self) -> None:
        """What the rollout backend's registry entry says it cannot run (engines/training/registry.py)."""
        lora = self.model.lora
        if lora is None:
            return
        try:
            ROLLOUT_ENGINES.entry(self.rollout.backend).check_lora_rank(lora.rank)
        except ValueError as err:
            raise field_error(("model", "lora", "rank"), str(err), lora.rank) from None

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
