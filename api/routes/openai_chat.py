"""A job's OpenAI-compatible endpoint: chat completions, completions and models (docs/ARCHITECTURE.md §5.1).

Served while a job with `rollout.source: external` runs. Calls through the base URL
`.../openai/trajectories/{trajectory_id}/v1` are recorded in that trajectory, so an agent framework
that sets only `base_url` and `api_key` needs nothing else; under `.../openai/v1` the
`X-Tandem-Trajectory` header names it (else each call is its own). Streaming sends OpenAI's chunks once
the completion is done.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from typing import Any, Literal

from fastapi import APIRouter, Header, Path
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, model_validator

from api.body_checks import CheckedRoute
from api.deps import AUTH_ERRORS, BODY_ERRORS, READ, WRITE, CallerDep, ServiceDep
from api.errors import documented
from api.routes.openai_bridge import call, check_model, external_job, model_names

router = APIRouter(
    prefix="/v1/jobs/{job_id}/openai",
    tags=["openai-compatible endpoint"],
    route_class=CheckedRoute,
    responses={**AUTH_ERRORS, **BODY_ERRORS, **documented(404, 409, 429, 503)},
)

TrajectoryId = Path(..., min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_.:-]+$")
TrajectoryHeader = Header(None, alias="X-Tandem-Trajectory", min_length=1, max_length=128,
                          pattern=r"^[A-Za-z0-9_.:-]+$")  # fmt: skip


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


@router.get("/v1/models", dependencies=READ)
@router.get("/trajectories/{trajectory_id}/v1/models", dependencies=READ, include_in_schema=False)
def models(job_id: str, service: ServiceDep, caller: CallerDep) -> dict[str, Any]:
    """The model this endpoint serves: the job, with its current weights."""
    job = external_job(service, job_id, caller.sees)
    created = int(job.started_at or job.created_at)
    data = [
        {"id": name, "object": "model", "created": created, "owned_by": job.owner}
        for name in model_names(job)
    ]
    return {"object": "list", "data": data}


@router.post("/v1/chat/completions", dependencies=WRITE)
async def chat_completions(
    job_id: str, body: ChatCompletionRequest, service: ServiceDep, caller: CallerDep,
    trajectory: str | None = TrajectoryHeader,
) -> Any:  # fmt: skip
    """A chat completion from the job's policy, recorded in the trajectory the header names (or a new one)."""
    return await _chat(job_id, trajectory, body, service, caller)


@router.post("/trajectories/{trajectory_id}/v1/chat/completions", dependencies=WRITE)
async def trajectory_chat_completions(
    job_id: str, body: ChatCompletionRequest, service: ServiceDep, caller: CallerDep,
    trajectory_id: str = TrajectoryId,
) -> Any:  # fmt: skip
    """A chat completion recorded in the trajectory of the base URL."""
    return await _chat(job_id, trajectory_id, body, service, caller)


@router.post("/v1/completions", dependencies=WRITE)
async def completions(
    job_id: str, body: CompletionRequest, service: ServiceDep, caller: CallerDep,
    trajectory: str | None = TrajectoryHeader,
) -> Any:  # fmt: skip
    """A text completion (no chat template), recorded like chat calls."""
    return await _completion(job_id, trajectory, body, service, caller)


@router.post("/trajectories/{trajectory_id}/v1/completions", dependencies=WRITE)
async def trajectory_completions(
    job_id: str, body: CompletionRequest, service: ServiceDep, caller: CallerDep,
    trajectory_id: str = TrajectoryId,
) -> Any:  # fmt: skip
    """A text completion recorded in the trajectory of the base URL."""
    return await _completion(job_id, trajectory_id, body, service, caller)


async def _chat(job_id: str, tid: str | None, body: ChatCompletionRequest, service: Any, caller: Any) -> Any:
    job = external_job(service, job_id, caller.sees)
    check_model(job, body.model)
    out = await call(job_id, "chat", tid, body.model_dump(exclude_none=True))
    return (
        _sse(_chat_chunks(out, body)) if body.stream else JSONResponse(out)
    )  # a plain dict: no encoder walk


async def _completion(
    job_id: str, tid: str | None, body: CompletionRequest, service: Any, caller: Any
) -> Any:
    job = external_job(service, job_id, caller.sees)
    check_model(job, body.model)
    payload = body.model_dump(exclude_none=True)
    payload["logprobs"] = body.logprobs is not None
    out = await call(job_id, "completion", tid, payload)
    return _sse(_completion_chunks(out, body)) if body.stream else JSONResponse(out)


def _sse(chunks: list[dict[str, Any]]) -> StreamingResponse:
    async def events() -> AsyncIterator[str]:
        for chunk in chunks:
            yield f"data: {json.dumps(chunk)}\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream")


def _head(out: dict[str, Any], kind: str) -> dict[str, Any]:
    return {"id": out["id"], "object": kind, "created": out.get("created", int(time.time())),
            "model": out["model"], "tandem": out.get("tandem")}  # fmt: skip


def _chat_chunks(out: dict[str, Any], body: ChatCompletionRequest) -> list[dict[str, Any]]:
    head, chunks = _head(out, "chat.completion.chunk"), []
    for c in out["choices"]:
        m = c["message"]
        delta: dict[str, Any] = {"role": "assistant", "content": m.get("content")}
        if m.get("tool_calls"):
            delta["tool_calls"] = [{**tc, "index": i} for i, tc in enumerate(m["tool_calls"])]
        chunks.append({**head, "choices": [{"index": c["index"], "delta": delta, "logprobs": c.get("logprobs"),
                                            "finish_reason": None}]})  # fmt: skip
        chunks.append(
            {**head, "choices": [{"index": c["index"], "delta": {}, "finish_reason": c["finish_reason"]}]}
        )
    if (body.stream_options or {}).get("include_usage"):
        chunks.append({**head, "choices": [], "usage": out["usage"]})
    return chunks


def _completion_chunks(out: dict[str, Any], body: CompletionRequest) -> list[dict[str, Any]]:
    head = _head(out, "text_completion")
    chunks = [{**head, "choices": [{**c, "finish_reason": None}]} for c in out["choices"]]
    chunks += [{**head, "choices": [{"index": c["index"], "text": "", "finish_reason": c["finish_reason"],
                                     "logprobs": None}]} for c in out["choices"]]  # fmt: skip
    if (body.stream_options or {}).get("include_usage"):
        chunks.append({**head, "choices": [], "usage": out["usage"]})
    return chunks
