"""A job's OpenAI Responses API: `POST .../v1/responses` (docs/ARCHITECTURE.md §5.1).

The OpenAI Agents SDK's default model (`OpenAIResponsesModel`) and `client.responses.create` call
this route. It is chat completions in other words (api/responses_items.py): the body is translated
into the chat call that means the same, which the job's endpoint actor templates, generates and
records token-exact in the trajectory the base URL or `X-Tandem-Trajectory` names, and the chat
answer is translated back into Responses output items. Responses are not stored: an agent sends the
whole conversation as `input` each call (as the Agents SDK does), and `previous_response_id` or
`conversation` is a 422. Streaming answers the SDK's event sequence, sent when the answer is done.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import Field, ValidationError

from api.body_checks import CheckedRoute
from api.deps import AUTH_ERRORS, BODY_ERRORS, WRITE, CallerDep, ServiceDep
from api.errors import APIError, documented
from api.responses_items import (
    chat_messages,
    chat_response_format,
    chat_tool_choice,
    chat_tools,
    response_object,
    stream_events,
)
from api.routes.openai_bridge import call, check_model, external_job
from api.routes.openai_chat import (
    ChatCompletionRequest,
    Lenient,
    TrajectoryHeader,
    TrajectoryId,
)

router = APIRouter(
    prefix="/v1/jobs/{job_id}/openai",
    tags=["openai-compatible endpoint"],
    route_class=CheckedRoute,
    responses={**AUTH_ERRORS, **BODY_ERRORS, **documented(404, 409, 429, 503)},
)
LOGPROBS = "message.output_text.logprobs"


class ResponsesRequest(Lenient):
    model: str = Field(..., min_length=1, max_length=512, description="the job's id (GET .../models)")
    input: str | list[dict[str, Any]] = Field(
        ...,
        max_length=10_000_000,
        description="a string, or message / function_call / function_call_output items",
    )
    instructions: str | None = Field(None, max_length=10_000_000, description="the system message")
    tools: list[dict[str, Any]] | None = Field(None, max_length=256, description="function tools")
    tool_choice: str | dict[str, Any] | None = None
    text: dict[str, Any] | None = Field(None, description="`format`: text, json_object or json_schema")
    max_output_tokens: int | None = Field(None, ge=1, le=1_048_576)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    seed: int | None = Field(None, ge=0, lt=2**63, description="makes sampling reproducible")
    parallel_tool_calls: bool | None = None
    include: list[str] | None = Field(None, max_length=32, description=f"'{LOGPROBS}': the tokens' log-probs")
    previous_response_id: str | None = Field(None, description="not served: responses are not stored")
    conversation: str | dict[str, Any] | None = Field(
        None, description="not served: responses are not stored"
    )
    stream: bool = False


@router.post("/v1/responses", dependencies=WRITE)
async def responses(
    job_id: str, body: ResponsesRequest, service: ServiceDep, caller: CallerDep,
    trajectory: str | None = TrajectoryHeader,
) -> Any:  # fmt: skip
    """A response from the job's policy, recorded in the trajectory the header names (or a new one)."""
    return await _respond(job_id, trajectory, body, service, caller)


@router.post("/trajectories/{trajectory_id}/v1/responses", dependencies=WRITE)
async def trajectory_responses(
    job_id: str, body: ResponsesRequest, service: ServiceDep, caller: CallerDep,
    trajectory_id: str = TrajectoryId,
) -> Any:  # fmt: skip
    """A response recorded in the trajectory of the base URL."""
    return await _respond(job_id, trajectory_id, body, service, caller)


def chat_request(body: ResponsesRequest) -> ChatCompletionRequest:
    """The chat completion request that means the same as `body`; a 422 naming the Responses field."""
    for name in ("previous_response_id", "conversation"):
        if getattr(body, name) is not None:
            raise APIError(422, f"{name}: responses are not stored here; send the whole conversation as `input`",
                           name, "unsupported_value")  # fmt: skip
    chat = {
        "model": body.model, "messages": chat_messages(body.instructions, body.input),
        "tools": chat_tools(body.tools), "tool_choice": chat_tool_choice(body.tool_choice),
        "response_format": chat_response_format(body.text), "max_tokens": body.max_output_tokens,
        "temperature": body.temperature, "top_p": body.top_p, "seed": body.seed,
        "logprobs": LOGPROBS in (body.include or []), "parallel_tool_calls": body.parallel_tool_calls,
    }  # fmt: skip
    try:
        return ChatCompletionRequest.model_validate({k: v for k, v in chat.items() if v is not None})
    except ValidationError as err:
        first = err.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        param = "input" if where.startswith("messages") else where
        raise APIError(422, f"{param}: {first['msg']}", param, "invalid_value") from None


def responses_param(param: str | None) -> str | None:
    """The Responses field that a chat field at fault stands for."""
    if param == "response_format":
        return "text.format"
    if param and param.startswith("tools[") and ".function." in param:
        return param.replace(".function.", ".", 1)
    return param


async def _respond(job_id: str, tid: str | None, body: ResponsesRequest, service: Any, caller: Any) -> Any:
    job = external_job(service, job_id, caller.sees)
    check_model(job, body.model)
    chat = chat_request(body)
    try:
        out = await call(job_id, "chat", tid, chat.model_dump(exclude_none=True))
    except APIError as err:  # the endpoint names the chat field: name the Responses one
        param = responses_param(err.param)
        if param != err.param:
            err.message, err.param = err.message.replace(err.param, param, 1), param
        raise
    response = response_object(out, body.model_dump(exclude_none=True))
    if not body.stream:
        return JSONResponse(response)

    async def events() -> AsyncIterator[str]:
        for event in stream_events(response):
            yield f"event: {event['type']}\ndata: {json.dumps(event)}\n\n"

    return StreamingResponse(events(), media_type="text/event-stream")
