"""What the operator can tune about the API: the `tandem serve` options."""

from __future__ import annotations

import os
from pathlib import Path

from pydantic import BaseModel, Field, field_validator

from service.quotas import Quota, QuotaBook
from service.tracker_policy import TrackerPolicy, host_entry
from workers.sandbox.limits import DEFAULT_CPU_S, DEFAULT_MEMORY_MB, Limits, unsandboxed_allowed

EXAMPLES_DIR = Path(__file__).resolve().parents[1] / "examples"
MiB = 1024 * 1024


class ServeSettings(BaseModel):
    max_body_bytes: int = Field(1 * MiB, gt=0, description="largest JSON request body; more is a 413")
    max_upload_bytes: int = Field(512 * MiB, gt=0, description="largest file upload (POST /v1/files)")
    metadata_max_keys: int = Field(16, ge=0, description="job metadata: at most this many keys")
    metadata_max_key_chars: int = Field(64, gt=0, description="job metadata: longest key")
    metadata_max_value_chars: int = Field(512, gt=0, description="job metadata: longest value")
    user_code_timeout_s: float = Field(
        30.0, gt=0, description="time a reward function or environment gets to import and be checked"
    )
    user_code_cpu_s: float = Field(
        default_factory=lambda: Limits.from_env().cpu_s or DEFAULT_CPU_S,
        gt=0,
        description="CPU seconds of one sandboxed check of user code; default $TANDEM_SANDBOX_CPU_S or 60",
    )
    user_code_memory_mb: int = Field(
        default_factory=lambda: Limits.from_env().memory_mb or DEFAULT_MEMORY_MB,
        ge=64,
        description="address space of each sandboxed user-code process, in MiB; default "
        "$TANDEM_SANDBOX_MEMORY_MB or 2048",
    )
    unsandboxed_user_code: bool = Field(
        default_factory=unsandboxed_allowed,
        description="run user code without a sandbox where bubblewrap cannot run (single-user services "
        "only: it then reads what the service reads); default $TANDEM_UNSANDBOXED_USER_CODE",
    )
    allowed_paths: list[Path] | None = Field(
        None,
        description="server folders every owner's specs may read from (shared data, models); default: the "
        "repo's examples/. Besides these, a spec may name only its owner's uploads and jobs' outputs",
    )
    tracker_hosts: list[str] = Field(
        default_factory=list,
        description="MLflow servers ('host' or 'host:port') a job's trainer.mlflow_uri may post to; none by "
        "default, this machine included",
    )
    allow_wandb: bool = Field(
        False, description="let jobs log to W&B (trainer.loggers: [wandb]) with the service's own W&B login"
    )

    @field_validator("tracker_hosts")
    @classmethod
    def _hosts(cls, hosts: list[str]) -> list[str]:
        return [host_entry(h) for h in hosts]

    tinker_base_models: list[str] | None = Field(
        None,
        description="base models the Tinker API serves (built-in names or HF folders); default: the built-ins",
    )
    tinker_max_rank: int = Field(
        64, ge=1, le=1024, description="the largest LoRA rank of a Tinker training model"
    )
    # The SDK splits a forward_backward into chunks unless one datum is larger: room for a datum of a
    # 1M-token context, as protobuf or JSON.
    tinker_max_body_bytes: int = Field(
        64 * MiB, gt=0, description="largest Tinker forward/forward_backward body as sent; more is a 413"
    )
    tinker_max_decompressed_bytes: int = Field(
        128 * MiB, gt=0, description="largest Tinker forward/forward_backward body after zstd; more is a 413"
    )
    tinker_max_pending_requests: int = Field(
        256,
        ge=1,
        description="Tinker requests one owner may have queued or running at once (each holds "
        "its body until done); more are a 429, which the SDK retries after a pause",
    )

    warm_controllers: int = Field(
        default_factory=lambda: os.environ.get("TANDEM_WARM_CONTROLLERS", "1"),
        validate_default=True,
        ge=0,
        le=16,
        description="job controllers kept started, their imports done, for the next jobs (0: none; "
        "each holds memory but no CPU or GPU); default $TANDEM_WARM_CONTROLLERS or 1",
    )

    quotas_file: Path | None = Field(
        None, description="a quotas file (JSON or YAML): {default: {...}, owners: {NAME: {...}}}"
    )
    default_quota: Quota = Field(
        default_factory=Quota, description="every owner's quota but the admin's (over the file's default)"
    )

    def user_code_limits(self) -> Limits:
        return Limits(cpu_s=self.user_code_cpu_s, memory_mb=self.user_code_memory_mb)

    def quota_book(self) -> QuotaBook:
        return QuotaBook.load(self.quotas_file, self.default_quota.model_dump(exclude_unset=True))

    def tinker_models(self) -> list[str]:
        from engines.models.tiny_models import BUILTIN_MODELS  # torch-free: names and shapes only

        return list(self.tinker_base_models or BUILTIN_MODELS)

    def shared_roots(self) -> list[Path]:
        """The folders (resolved) every owner's specs may read from (service/owned_paths.py)."""
        extra = [EXAMPLES_DIR] if self.allowed_paths is None else self.allowed_paths
        return [Path(p).expanduser().resolve() for p in extra]

    def tracker_policy(self) -> TrackerPolicy:
        return TrackerPolicy.of(self.tracker_hosts, self.allow_wandb)
