"""A job's OpenAI Responses API, `POST .../v1/responses` (the Agents SDK's default model), served and
recorded as the chat call that means the same (api/routes/openai_endpoint.py). The translation inverts
itself on what an agent sends back: an answer's `message` and `function_call` items, returned as input,
become the assistant message the trajectory recorded, so the conversation continues its tokens.
Responses are not stored: an agent sends the whole conversation as `input` (`previous_response_id`: 422).
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from pydantic import Field, ValidationError, field_validator

from api.errors import APIError, invalid
from schema.openai_bodies import ChatCompletionRequest, Lenient

LOGPROBS = "message.output_text.logprobs"
TEXT_PARTS = ("input_text", "output_text", "text")


def _text(content: Any, where: str) -> str:
    """A message's content as text: a string or a list of text parts (other parts are refused)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise invalid(where, "must be a string or a list of text parts")
    texts = []
    for k, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "refusal" and isinstance(part.get("refusal"), str):
            texts.append(part["refusal"])
        elif kind in TEXT_PARTS and isinstance(part.get("text"), str):
            texts.append(part["text"])
        else:
            raise invalid(f"{where}[{k}]", f"content part of type {kind!r} is not supported: text parts only")
    return "".join(texts)


def _field(item: dict[str, Any], key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str) or not value and key != "arguments":
        raise invalid(f"{where}.{key}", "a non-empty string is required")
    return value


def chat_messages(instructions: str | None, items: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The chat messages that mean `instructions` + `input`; a 422 naming the item it cannot read."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": instructions}] if instructions else []
    if isinstance(items, str):
        return [*messages, {"role": "user", "content": items}]
    calling: dict[str, Any] | None = None  # the assistant message that function_call items join
    for i, item in enumerate(items):
        where = f"input[{i}]"
        kind = item.get("type", "message")
        if kind == "function_call":
            call = {"id": _field(item, "call_id", where), "type": "function",
                    "function": {"name": _field(item, "name", where), "arguments": _field(item, "arguments", where)}}  # fmt: skip
            if calling is None:
                calling = {"role": "assistant", "content": None, "tool_calls": []}
                messages.append(calling)
            calling.setdefault("tool_calls", []).append(call)
            continue
        calling = None
        if kind == "function_call_output":
            output = _text(item.get("output"), f"{where}.output")
            messages.append(
                {"role": "tool", "tool_call_id": _field(item, "call_id", where), "content": output}
            )
        elif kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise invalid(f"{where}.role", "must be one of user, system, developer, assistant")
            messages.append({"role": role, "content": _text(item.get("content"), f"{where}.content")})
            if role == "assistant":
                calling = messages[-1]
        else:
            raise invalid(f"{where}.type", f"item type {kind!r} is not served here: message, function_call "
                          "and function_call_output items only (send the whole conversation as input)")  # fmt: skip
    if not messages:
        raise invalid("input", "at least one item is required")
    return messages


def chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    if tools is None:
        return None
    out = []
    for i, tool in enumerate(tools):
        if tool.get("type") != "function":
            raise invalid(
                f"tools[{i}].type", f"tool type {tool.get('type')!r} is not served here: function tools only"
            )
        function = {"name": _field(tool, "name", f"tools[{i}]")}
        function |= {k: tool[k] for k in ("description", "parameters", "strict") if tool.get(k) is not None}
        out.append({"type": "function", "function": function})
    return out


def chat_tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    if choice is None or isinstance(choice, str):
        return choice
    if choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise invalid("tool_choice", "must be 'none', 'auto', 'required' or {'type': 'function', 'name': ...}")


def chat_response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    form = (text or {}).get("format")
    if form is not None and not isinstance(form, dict):
        raise invalid("text.format", "must be an object with a 'type'")
    if form is None or form.get("type") == "text":
        return None
    if form.get("type") == "json_object":
        return {"type": "json_object"}
    if form.get("type") == "json_schema":
        keys = ("name", "schema", "strict", "description")
        return {"type": "json_schema", "json_schema": {k: form[k] for k in keys if k in form}}
    raise invalid("text.format.type", "must be 'text', 'json_object' or 'json_schema'")


def response_object(out: dict[str, Any], request: dict[str, Any]) -> dict[str, Any]:
    """The Responses `Response` of a chat answer `out` (its first choice) to the call `request`."""
    choice = out["choices"][0]
    message, cut = choice["message"], choice["finish_reason"] == "length"
    calls = message.get("tool_calls") or []
    items: list[dict[str, Any]] = []
    if message.get("content") or not calls:
        logprobs = (choice.get("logprobs") or {}).get("content") or []
        text = message.get("content") or ""
        part = {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs}
        items.append({"type": "message", "id": f"msg_{uuid.uuid4().hex[:24]}", "role": "assistant",
                      "status": "incomplete" if cut else "completed", "content": [part]})  # fmt: skip
    for tool_call in calls:
        function = tool_call["function"]
        items.append({"type": "function_call", "id": f"fc_{uuid.uuid4().hex[:24]}", "call_id": tool_call["id"],
                      "name": function["name"], "arguments": function["arguments"],
                      "status": "completed"})  # fmt: skip
    usage = out["usage"]
    return {
        "id": f"resp_{uuid.uuid4().hex[:24]}", "object": "response", "created_at": out.get("created", int(time.time())),
        "completed_at": int(time.time()), "status": "incomplete" if cut else "completed",
        "incomplete_details": {"reason": "max_output_tokens"} if cut else None, "error": None,
        "model": request["model"], "instructions": request.get("instructions"), "output": items,
        "tools": request.get("tools") or [], "tool_choice": request.get("tool_choice") or "auto",
        "parallel_tool_calls": request.get("parallel_tool_calls", True),
        "temperature": request.get("temperature"), "top_p": request.get("top_p"),
        "max_output_tokens": request.get("max_output_tokens"), "text": request.get("text") or {"format": {"type": "text"}},
        "metadata": request.get("metadata") or {}, "store": False,
        "usage": {"input_tokens": usage["prompt_tokens"], "input_tokens_details": {"cached_tokens": 0},
                  "output_tokens": usage["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
                  "total_tokens": usage["total_tokens"]},
        "tandem": out.get("tandem"),
    }  # fmt: skip


def stream_events(response: dict[str, Any]) -> list[dict[str, Any]]:
    """The Server-Sent Events of a whole response, in the order the `openai` SDK accumulates them."""
    events: list[dict[str, Any]] = []

    def emit(kind: str, **fields: Any) -> None:
        events.append({"type": kind, "sequence_number": len(events), **fields})

    opening = {**response, "status": "in_progress", "output": [], "usage": None, "incomplete_details": None}
    emit("response.created", response=opening)
    emit("response.in_progress", response=opening)
    for index, item in enumerate(response["output"]):
        at = {"item_id": item["id"], "output_index": index}
        if item["type"] == "message":
            opened = {**item, "status": "in_progress", "content": []}
            emit("response.output_item.added", output_index=index, item=opened)
            part, at = item["content"][0], {**at, "content_index": 0}
            emit("response.content_part.added", **at, part={**part, "text": "", "logprobs": []})
            emit("response.output_text.delta", **at, delta=part["text"], logprobs=part["logprobs"])
            emit("response.output_text.done", **at, text=part["text"], logprobs=part["logprobs"])
            emit("response.content_part.done", **at, part=part)
        else:
            opened = {**item, "status": "in_progress", "arguments": ""}
            emit("response.output_item.added", output_index=index, item=opened)
            emit("response.function_call_arguments.delta", **at, delta=item["arguments"])
            done = {"name": item["name"], "arguments": item["arguments"]}
            emit("response.function_call_arguments.done", **at, **done)
        emit("response.output_item.done", output_index=index, item=item)
    emit(f"response.{response['status']}", response=response)
    return events


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
    top_logprobs: int | None = Field(None, description="not served: only 0")

    @field_validator("top_logprobs")
    @classmethod
    def _not_served(cls, value: int | None) -> int | None:
        if value:
            raise ValueError(
                "top_logprobs is not served: only the sampled tokens' own log-probs are (leave it out, or 0)"
            )
        return value


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


def name_responses_field(err: APIError) -> None:
    """Names, in the error the chat call raised, the Responses field that its chat field stands for."""
    param = err.param
    if param == "response_format":
        param = "text.format"
    elif param and param.startswith("tools[") and ".function." in param:
        param = param.replace(".function.", ".", 1)
    if param != err.param:
        err.message, err.param = err.message.replace(err.param, param, 1), param
