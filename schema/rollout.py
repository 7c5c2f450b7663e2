"""`rollout`: how a job generates (backend, sampling, multi-turn environments, external agents).

The fields a lower layer also reads are declared there and inherited: the colocated worker's
(schema/workers.py RolloutOptions, EnvironmentOptions) and the sampler's (engines.rollout
SamplingKnobs, torch-free). `sampling_params` and `environment_config` hand the workers their own
models, typed.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from engines.rollout.base import SamplingKnobs, SamplingParams
from schema.external import ExternalSpec
from schema.section import Section, field_error, fields_of
from schema.workers import EnvironmentConfig, EnvironmentOptions, RolloutOptions


class RolloutSpec(Section, RolloutOptions, SamplingKnobs, EnvironmentOptions):
    """Generation: backend and memory behaviour in the colocated worker (RolloutOptions), sampling
    (SamplingKnobs), multi-turn environments (EnvironmentOptions), and the group size and response
    length of the job."""

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
