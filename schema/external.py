"""`rollout.external`: a job fed by agents through its OpenAI-compatible endpoint (torch-free).

With `rollout.source: external` the job does not draw prompts from its data: agents call
`/v1/jobs/{id}/openai/...` (schema/openai_bodies.py), every call is recorded token-exact in its
trajectory (controller/external.py), and a step trains once `trajectories_per_step` rewarded
trajectories form complete groups of `group_size` with the same task id. An agent the job runs
itself (`agent`) is loaded by controller/agent_sandbox.py.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from schema.section import field_error


def server_name(job_id: str) -> str:
    """The Ray actor that serves a job's endpoint (controller/external.py), found by the API by name."""
    return f"tandem-openai-{job_id}"


class ExternalSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    group_size: int = Field(4, ge=1, le=4096, description="trajectories of one task id per GRPO group")
    trajectories_per_step: int = Field(
        16, ge=1, le=1 << 20, description="rewarded trajectories a step trains on (a multiple of group_size)"
    )
    reward_timeout_s: float = Field(
        600.0,
        gt=0,
        le=7 * 86400,
        description="a trajectory with no reward this long after its last call is dropped (and counted)",
    )
    max_pending: int | None = Field(
        None,
        ge=1,
        le=1 << 20,
        description="trajectories open or waiting for a step at once; a call that would open one more is "
        "answered 429 with Retry-After; None = 4 x trajectories_per_step",
    )
    agent: str | None = Field(
        None,
        max_length=2048,
        description="an agent the job runs itself, in worker processes: 'module:function' or "
        "'path/file.py:function', called as function(client, model, index) with an openai.OpenAI client "
        "recording one trajectory; returns the reward or {reward, task_id?, turn_rewards?, metadata?}; or a "
        "verifiers environment's Taskset class (docs/guides/verifiers.md)",
    )
    agent_args: dict[str, Any] | None = Field(None, description="arguments of the verifiers environment agent names: its TasksetConfig's fields")  # fmt: skip
    agent_workers: int = Field(2, ge=1, le=256, description="agent calls under way at once (processes)")
    agent_timeout_s: float = Field(
        300.0, gt=0, le=86400, description="time limit of one agent call; past it its process is replaced"
    )
    batch_window_ms: float = Field(
        250.0,
        ge=0,
        le=1000,
        description="the longest a call waits for others to share its engine batch: calls are gathered until "
        "as many arrived as the last batch held, or this passed (a lone agent never waits)",
    )

    @field_validator("agent_args")
    @classmethod
    def _json_args(cls, args: dict[str, Any] | None) -> dict[str, Any] | None:
        try:
            json.dumps(args, allow_nan=False)
        except (TypeError, ValueError) as err:  # NaN, Infinity: not JSON, whatever the parser let through
            raise ValueError(f"must be JSON: {err}") from None
        return args

    @model_validator(mode="after")
    def _whole_groups(self) -> ExternalSpec:
        if self.trajectories_per_step % self.group_size:
            raise field_error(("trajectories_per_step",),
                f"trajectories_per_step = {self.trajectories_per_step} must be a multiple of "
                f"group_size = {self.group_size}", self.trajectories_per_step, named=False
            )  # fmt: skip
        if self.agent_args is not None and self.agent is None:
            raise field_error(("agent_args",), "agent_args needs an agent: a verifiers environment's Taskset",
                              self.agent_args, named=False)  # fmt: skip
        return self

    @property
    def pending_limit(self) -> int:
        return self.max_pending or 4 * self.trajectories_per_step
