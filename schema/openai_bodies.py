"""The bodies of a job's OpenAI chat and text completion calls (OpenAI's fields, bounded, and text content
only) and of a trajectory's reward. The API checks them (api/routes/openai_endpoint.py), and so does the job's endpoint actor
(controller/external.py), which an agent the job runs in its sandbox calls without the API."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

# Any reward (posted, a reward function's, an environment's): advantages in float32 stay finite.
MAX_ABS_REWARD = 1e6
MAX_METADATA_DEPTH = (
    32  # a reward's metadata is answered back as JSON, which stops far deeper than a body may nest
)


class Lenient(BaseModel):
    model_config = ConfigDict(extra="allow")  # OpenAI's optional fields a job does not use are accepted


class FunctionCall(BaseModel):
    name: str = Field(..., min_length=1, max_length=256)
    arguments: str = Field("{}", max_length=1_000_000)


class ToolCall(Lenient):
    id: str | None = Field(None, max_length=256)
    type: Literal["function"] = "function"
    function: FunctionCall


class ContentPart(Lenient):
    type: str = Field(..., max_length=64)
    text: str | None = Field(None, max_length=10_000_000)


class ChatMessage(Lenient):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = Field(None, max_length=256)
    tool_calls: list[ToolCall] | None = Field(None, max_length=256)
    tool_call_id: str | None = Field(None, max_length=256)

    @model_validator(mode="after")
    def _text_only(self) -> ChatMessage:
        if isinstance(self.content, list) and any(p.type != "text" for p in self.content):
            raise ValueError("only text content parts are supported")
        if self.content is None and not self.tool_calls:
            raise ValueError(f"a '{self.role}' message needs content")
        return self


class FunctionSpec(Lenient):
    name: str = Field(..., min_length=1, max_length=256)
    description: str | None = Field(None, max_length=100_000)
    parameters: dict[str, Any] | None = None


class ToolSpec(Lenient):
    type: Literal["function"] = "function"
    function: FunctionSpec


class Sampling(Lenient):
    model: str = Field(..., min_length=1, max_length=512, description="the job's id (GET .../models)")
    n: int = Field(1, ge=1, le=64, description="choices; choice k > 0 is trajectory '<id>.<k>'")
    max_tokens: int | None = Field(None, ge=1, le=1_048_576)
    max_completion_tokens: int | None = Field(None, ge=1, le=1_048_576)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    stop: str | list[str] | None = Field(None, description="up to 4 stop strings")
    seed: int | None = Field(None, ge=0, lt=2**63)
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    # Served as no-ops only: a penalty or bias would sample from another distribution than the
    # policy's, and no alternatives to the sampled tokens are computed.
    logit_bias: dict[str, float] | None = Field(None, description="not served: only empty")
    presence_penalty: float | None = Field(None, description="not served: only 0")
    frequency_penalty: float | None = Field(None, description="not served: only 0")
    top_logprobs: int | None = Field(
        None, description="not served: only 0 (the sampled tokens' own log-probs are)"
    )

    @field_validator("logit_bias", "presence_penalty", "frequency_penalty", "top_logprobs")
    @classmethod
    def _not_served(cls, value: Any, info: ValidationInfo) -> Any:
        if value:
            raise ValueError(
                f"{info.field_name} is not served: the job samples from its policy's own distribution, "
                "which is what it trains on (leave it out, or 0)"
            )
        return value

    @model_validator(mode="after")
    def _stops(self) -> Sampling:
        stops = [self.stop] if isinstance(self.stop, str) else self.stop or []
        if len(stops) > 4 or any(not s or len(s) > 256 for s in stops):
            raise ValueError("stop: at most 4 non-empty strings of up to 256 characters")
        return self


class ChatCompletionRequest(Sampling):
    messages: list[ChatMessage] = Field(..., min_length=1, max_length=10_000)
    tools: list[ToolSpec] | None = Field(None, max_length=256)
    tool_choice: str | dict[str, Any] | None = Field(
        None,
        description="'auto'; 'none': the tools left out of the prompt and no calls parsed; 'required' or "
        "{'type': 'function', 'function': {'name': ...}}: the reply is one call (constrained decoding)",
    )
    parallel_tool_calls: bool | None = Field(None, description="false: at most one tool call per reply")
    response_format: dict[str, Any] | None = Field(
        None,
        description="{'type': 'text' | 'json_object' | 'json_schema', 'json_schema': {'name', 'schema', "
        "'strict'}}: enforced by constrained decoding; a schema keyword it cannot enforce is a 422",
    )
    logprobs: bool = False


class CompletionRequest(Sampling):
    prompt: str = Field(..., max_length=10_000_000)
    logprobs: int | None = Field(None, ge=0, le=20, description="any value: the sampled tokens' log-probs")


class RewardRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    reward: float = Field(
        ..., ge=-MAX_ABS_REWARD, le=MAX_ABS_REWARD, description="the trajectory's reward (its GRPO score)"
    )
    task_id: str | None = Field(
        None, min_length=1, max_length=256,
        description="trajectories with the same task id form a GRPO group; default: the trajectory's id",
    )  # fmt: skip
    turn_rewards: list[float] | None = Field(None, max_length=100_000, description="optional, per call")
    metadata: dict[str, Any] | None = Field(None, description="kept with the trajectory")

    @field_validator("metadata")
    @classmethod
    def _shallow(cls, metadata: dict[str, Any] | None) -> dict[str, Any] | None:
        stack = [(metadata, 1)]
        while stack:
            value, depth = stack.pop()
            if depth > MAX_METADATA_DEPTH:
                raise ValueError(f"nests deeper than {MAX_METADATA_DEPTH} levels")
            children = value.values() if isinstance(value, dict) else value if isinstance(value, list) else []
            stack.extend((child, depth + 1) for child in children)
        return metadata
