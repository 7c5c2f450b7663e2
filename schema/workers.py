"""The workers' configuration: what a worker is built with, and the typed arguments of its calls.

Neither torch nor Ray: the JobSpec sections (schema/rollout.py, schema/training.py) inherit the
fields they share with a model here, so every setting is declared and bounded once. The controller
hands the workers these models, never dicts; a worker also accepts the equivalent dict (tests and
scripts), validated by the same model. The loss options live beside them in schema/losses.py.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from engines.rollout import ROLLOUT_ENGINES, check_tensor_parallel
from schema.engine import Dtype, EngineConfig


class _Config(BaseModel):
    model_config = ConfigDict(extra="forbid")


class UpdateSchedule(_Config):
    """How one update call walks its batch (workers/operations.train_on_batch): mini-batches, epochs, order."""

    mini_batch_size: int | None = Field(
        None, gt=0, description="samples per optimizer step over all dp ranks; None = the whole batch"
    )
    epochs: int = Field(1, ge=1, description="passes over the batch")
    shuffle: bool = Field(True, description="visit rows in a seeded random order each epoch")
    seed: int = Field(0, description="seed of the row order (the controller passes the step)")


class RolloutOptions(_Config):
    """How the colocated worker runs its rollout engine. JobSpec.rollout inherits these fields."""

    backend: str = Field(
        "auto",
        description="rollout engine, by its name in engines.rollout.ROLLOUT_ENGINES; 'auto': vllm on CUDA "
        "when installed, then sglang, else 'hf' (on a CPU always 'hf'); the job's 'building' event names "
        "the one chosen",
        json_schema_extra=lambda schema: schema.update(enum=ROLLOUT_ENGINES.names()),
    )
    tensor_parallel_size: int = Field(1, ge=1, le=1024, description="devices one rollout replica spans")
    bucket_mb: float = Field(512, gt=0, le=1_048_576, description="weight-sync bucket size")
    free_cache_after_generate: bool | None = Field(
        None,
        description="release rollout memory between generations (and around a weight sync); null: when the "
        "engine finds its device short of memory (vllm and sglang always, their caches fill the device; hf "
        "on CUDA when under a quarter of the device is free, never on a CPU)",
    )
    offload_trainer_during_rollout: bool = Field(
        False,
        description="placement 'colocated' only: move the training role's engines (the actor's parameters "
        "and optimizer state, the reference model's parameters) to host memory while the rollout engine "
        "generates, and back after it; on a CPU they are in host memory already and nothing moves",
    )
    weight_transfer: Literal["collective", "object_store"] = Field(
        "collective",
        description="how weights reach rollout workers placed apart (resources.placement 'split'): "
        "'collective' (a torch.distributed group made for it: gloo on CPU, NCCL on GPU) or 'object_store' "
        "(Ray's); colocated workers always copy in process; with "
        "model.lora the adapter alone goes through the object store either way",
    )

    @field_validator("backend")
    @classmethod
    def _known_backend(cls, name: str) -> str:
        return ROLLOUT_ENGINES.check(name)

    @model_validator(mode="after")
    def _tensor_parallel_supported(self) -> Any:
        check_tensor_parallel(self.backend, self.tensor_parallel_size)
        return self


class RolloutConfig(RolloutOptions):
    """What the hybrid worker builds its rollout engine with."""

    dtype: Dtype = Field("auto", description="the policy's compute dtype; auto: bf16 on CUDA, fp32 on CPU")
    engine_kwargs: dict[str, Any] = Field(
        default_factory=dict, description="extra rollout-engine constructor arguments"
    )


class HybridWorkerConfig(_Config):
    """The training role and the hybrid actor-rollout-ref worker (workers/actor_role.py): its rollout
    section says how the rollout engine is built (hybrid) and how weights reach it (both)."""

    actor: EngineConfig
    ref: EngineConfig | None = Field(None, description="reference model for KL; None = no reference")
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)


class EnvironmentOptions(_Config):
    """Multi-turn rollouts (workers/multiturn.py). JobSpec.rollout inherits these fields."""

    environment: str | None = Field(
        None,
        description="multi-turn: 'builtin:NAME', 'module:Class' or 'path/file.py:Class' "
        "(workers/environments/base.py); None = one response per prompt",
    )
    max_turns: int = Field(4, ge=1, le=1024, description="multi-turn: assistant turns per trajectory")
    max_response_tokens: int = Field(
        256, gt=0, le=1_048_576, description="multi-turn: token budget of a trajectory after its first prompt"
    )
    env_step_timeout_s: float = Field(
        10.0, gt=0, le=3600, description="multi-turn: time limit of one environment reset or step"
    )


# The names this worker model had before it inherited the JobSpec's: still accepted (scripts, tests).
_FORMER_ENVIRONMENT_NAMES = {"ref": "environment", "step_timeout_s": "env_step_timeout_s"}


class EnvironmentConfig(EnvironmentOptions):
    """What a worker's multi-turn rollout runs with (`workers.batch.environment_of`): the options of
    a job with an environment, and how many environment steps a worker runs at once."""

    threads: int = Field(32, ge=1, le=4096, description="environment steps run at once")

    @model_validator(mode="before")
    @classmethod
    def _former_names(cls, data: Any) -> Any:
        if isinstance(data, dict) and any(k in data for k in _FORMER_ENVIRONMENT_NAMES):
            return {_FORMER_ENVIRONMENT_NAMES.get(k, k): v for k, v in data.items()}
        return data

    @model_validator(mode="after")
    def _has_environment(self) -> EnvironmentConfig:
        if self.environment is None:
            raise ValueError("a multi-turn rollout needs an environment reference ('builtin:NAME', ...)")
        return self


class RolloutWorkerConfig(_Config):
    """The rollout role on its own workers (workers/rollout_role.py)."""

    model_path: str = Field(description="the policy's HF folder; later weights arrive by transfer")
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    lora_rank: int | None = Field(
        None, description="the job's LoRA rank: adapters up to it arrive by transfer (None: no LoRA)"
    )
