"""Configuration of a training engine: one small validated model per concern.

`EngineConfig` is what a training role hands to its training engine (chosen by `engine`, FSDP by
default): where the model is, how it is sharded and offloaded, how it is optimised and scheduled,
and how a batch is cut into micro-batches. Every section forbids unknown keys and checks what it
can on construction, so a bad value fails where it was written rather than deep inside a training
step.

Each setting is declared once, here: the JobSpec sections (schema/training.py) inherit these
models (JobSpec.optim from OptimizerConfig and WarmupDecay, JobSpec.algorithm from
MicroBatchConfig) and rebuild the engine's models with `schema.section.fields_of`, so a bound or a
cross-field rule written here is checked when a job is submitted. Neither torch nor Ray.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from engines.training.registry import TRAIN_ENGINES

Dtype = Literal["auto", "float32", "bfloat16"]
ScheduleKind = Literal["constant", "cosine"]


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class FSDPConfig(_Section):
    """How parameters are sharded and where they live between uses."""

    reshard_after_forward: bool | None = Field(
        None,
        description=(
            "free the gathered parameters of a layer after its forward (ZeRO-3); False = ZeRO-2, which "
            "also keeps them gathered across a call's micro-batches; None = True over several ranks, "
            "False on one (its 'shards' are whole: resharding would only re-cast and re-copy them)"
        ),
    )
    param_offload: bool = Field(False, description="keep parameter shards on the CPU outside train/eval mode")
    optimizer_offload: bool = Field(False, description="keep optimizer state on the CPU outside train mode")


class OptimizerConfig(_Section):
    """AdamW with global-norm gradient clipping."""

    lr: float = Field(1e-5, gt=0, le=10, description="peak learning rate (AdamW)")
    betas: tuple[float, float] = Field((0.9, 0.999), description="AdamW's moment decay rates, each in [0, 1)")
    weight_decay: float = Field(0.0, ge=0, le=100, description="AdamW's decoupled weight decay")
    eps: float = Field(1e-8, gt=0, description="AdamW's denominator epsilon")
    grad_clip: float | None = Field(
        1.0, gt=0, le=1e6, description="max global grad norm; None disables clipping"
    )

    @model_validator(mode="after")
    def _betas_in_range(self) -> OptimizerConfig:
        if not all(0 <= b < 1 for b in self.betas):
            raise ValueError(f"optim.betas must each be in [0, 1), got {self.betas}")
        return self


class WarmupDecay(_Section):
    """The schedule's shape: warmup length and the floor the cosine decays to."""

    warmup_steps: int = Field(0, ge=0, le=100_000_000, description="steps of linear warmup from 0 to lr")
    min_lr_ratio: float = Field(0.0, ge=0, le=1, description="cosine: the final lr as a fraction of lr")


class SchedulerConfig(WarmupDecay):
    """Learning-rate schedule: constant, or linear warmup then cosine decay to min_lr_ratio * lr."""

    kind: ScheduleKind = "constant"
    warmup_ratio: float | None = Field(None, ge=0, lt=1, description="overrides warmup_steps when set")
    total_steps: int = Field(1, gt=0, description="optimizer steps the cosine decays over")

    @property
    def resolved_warmup_steps(self) -> int:
        if self.warmup_ratio is not None:
            return int(self.warmup_ratio * self.total_steps)
        return self.warmup_steps


class MicroBatchConfig(_Section):
    """Either a fixed number of samples per micro-batch, or a token budget (dynamic batching).

    With neither, dynamic batching under an automatic budget (`engines.training.microbatch.auto_token_budget`:
    from the model's hidden size and the device), never below the longest sequence.
    """

    micro_batch_size: int | None = Field(None, gt=0, le=1 << 20, description="samples per micro-batch")
    max_tokens_per_micro_batch: int | None = Field(
        None,
        gt=0,
        le=1 << 40,
        description="dynamic: at most this many real tokens per micro-batch as packed (a prompt that "
        "rows of one micro-batch share counts once), balanced",
    )

    @model_validator(mode="after")
    def _at_most_one(self) -> MicroBatchConfig:
        if self.micro_batch_size is not None and self.max_tokens_per_micro_batch is not None:
            raise ValueError(
                "micro_batch_size and max_tokens_per_micro_batch are exclusive: "
                "give a fixed size or a token budget, not both"
            )
        return self


MAX_LORA_RANK = 1024  # beyond this an adapter is no longer low-rank for any model Tandem trains
ALL_LINEAR = "all-linear"


class LoraConfig(_Section):
    """Low-rank adapters (LoRA) on the policy's linear layers; the base model stays frozen.

    The update of a target linear layer W is `(alpha / rank) * B @ A` with A [rank, in], B [out, rank]
    (B starts at zero, so a new adapter starts at the base policy). See docs/ARCHITECTURE.md, "LoRA".
    """

    rank: int = Field(16, ge=1, le=MAX_LORA_RANK, description="the adapters' rank r")
    alpha: float = Field(
        32.0,
        gt=0,
        le=1_000_000,
        description="scaling numerator: the update is (alpha / rank) * B @ A; keep 32 when changing the rank",
    )
    dropout: float = Field(0.0, ge=0, lt=1, description="dropout on the adapters' input while training")
    target_modules: Literal["all-linear"] | list[str] = Field(
        ALL_LINEAR,
        description="'all-linear' (every linear layer but the output projection) or module names, "
        "e.g. ['q_proj', 'v_proj']",
    )
    init_from: str | None = Field(
        None,
        description="start from an adapter: a PEFT adapter folder (adapter_config.json, "
        "adapter_model.safetensors) or an uploaded adapter_model.safetensors (file id)",
    )

    @field_validator("target_modules")
    @classmethod
    def _some_targets(cls, value: str | list[str]) -> str | list[str]:
        if isinstance(value, list):
            if not value or len(value) > 256:
                raise ValueError("give 1 to 256 module names, or 'all-linear'")
            bad = [
                v for v in value if not v or len(v) > 128 or not v.replace("_", "").replace(".", "").isalnum()
            ]
            if bad:
                raise ValueError(f"module names are letters, digits, '_' and '.': {bad[:3]}")
            return sorted(set(value))
        return value

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank


class CollectiveTimeout(_Section):
    """How long a training rank waits for its peers in one collective."""

    collective_timeout_s: float = Field(
        600.0,
        ge=1,
        le=86_400,
        description="seconds a training rank waits for its peers in a collective (a gather, a reduce) before it "
        "fails; a peer that then neither answers nor fails is hung: it is killed and the job restarts from "
        "its last checkpoint (trainer.max_restarts). The ranks' start is not bound by it",
    )


class EngineConfig(CollectiveTimeout):
    """Everything an FSDP training engine needs; defaults train a tiny model on a laptop CPU."""

    model_path: str = Field(
        ..., description="local Hugging Face folder (config.json, safetensors, tokenizer)"
    )
    engine: str = Field(
        "fsdp", description="training engine, by its name in engines.training.registry.TRAIN_ENGINES"
    )
    role: Literal["policy", "value"] = Field("policy", description="value: a scalar head for the critic")
    trainable: bool = Field(True, description="False: forward only, no optimizer (the reference model)")
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="auto: cuda when available")
    dtype: Dtype = Field(
        "auto",
        description="compute dtype; auto: bf16 on CUDA, fp32 on CPU. Master weights stay fp32; bfloat16 on "
        "one CPU rank runs the linear layers in bf16 under autocast (attention and the log-prob head in fp32)",
    )
    attn_implementation: Literal["auto", "sdpa", "flash_attention_2", "eager"] = "auto"
    fsdp: FSDPConfig = Field(default_factory=FSDPConfig)
    optim: OptimizerConfig = Field(default_factory=OptimizerConfig)
    scheduler: SchedulerConfig = Field(default_factory=SchedulerConfig)
    micro_batch: MicroBatchConfig = Field(default_factory=MicroBatchConfig)
    gradient_checkpointing: bool = False
    lora: LoraConfig | None = Field(None, description="train low-rank adapters over a frozen base")
    share_prompts: bool = Field(
        True,
        description="run a prompt that repeats in a micro-batch (a GRPO group) once, its responses reading "
        "its keys and values (engines/kernels/shared_prompt.py); with the packed-row SDPA attention, not flash-attention",
    )
    logprob_chunk_tokens: int = Field(
        1024, gt=0, description="tokens per chunk of the vocabulary projection, bounds fp32 logits memory"
    )
    logprob_keep_mib: int = Field(
        512,
        ge=0,
        le=1 << 20,
        description="keep a micro-batch's fp32 log-softmax over the vocabulary for the backward when it fits "
        "in this many MiB (skips recomputing the vocabulary projection); 0 always recomputes",
    )
    seed: int = 0

    @field_validator("engine")
    @classmethod
    def _known_engine(cls, name: str) -> str:
        return TRAIN_ENGINES.check(name)

    @model_validator(mode="after")
    def _offload_needs_something_to_offload(self) -> EngineConfig:
        if self.fsdp.optimizer_offload and not self.trainable:
            raise ValueError(
                "fsdp.optimizer_offload is set on an engine with trainable=False, which has no optimizer"
            )
        return self
