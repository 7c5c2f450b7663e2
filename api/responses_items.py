"""The Responses API in terms of chat completions: a request's items to chat messages, a chat
answer back to Responses output items (docs/ARCHITECTURE.md §5.1). Torch-free, no I/O.

A job's endpoint has one engine path, chat completions (controller/external.py): a Responses call
is translated into the chat call that means the same, so it is templated, extended by a token delta
and recorded exactly as that chat call would be. The translation is the inverse of itself on what
an agent sends back: an answer's `message` and `function_call` items, returned as the next call's
input, become the assistant message the trajectory recorded (the same text, the same calls), so
the conversation continues the trajectory's tokens rather than starting a new segment.

- `instructions` -> a system message first; `input` (a string, or items) -> messages: `message`
  items (or bare `{"role", "content"}`) with text parts; consecutive `function_call` items join the
  assistant message before them (or make one); `function_call_output` -> a `tool` message.
- `tools` (function tools) -> chat tools; `tool_choice` -> chat's; `text.format` -> `response_format`.
- The chat answer -> a `message` item (its text, unless it is empty and the turn called tools) and
  one `function_call` item per tool call (`call_id` = the chat tool call's id); `finish_reason`
  "length" -> status `incomplete` (`max_output_tokens`).
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from api.errors import APIError

TEXT_PARTS = ("input_text", "output_text", "text")


def _refuse(param: str, why: str) -> APIError:
    return APIError(422, f"{param}: {why}", param, "invalid_value")


def _text(content: Any, where: str) -> str:
    """A message's content as text: a string or a list of text parts (other parts are refused)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _refuse(where, "must be a string or a list of text parts")
    texts = []
    for k, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "refusal" and isinstance(part.get("refusal"), str):
            texts.append(part["refusal"])
        elif kind in TEXT_PARTS and isinstance(part.get("text"), str):
            texts.append(part["text"])
        else:
            raise _refuse(f"{where}[{k}]", f"content part of type {kind!r} is not supported: text parts only")
    return "".join(texts)


def _field(item: dict[str, Any], key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str) or not value and key != "arguments":
        raise _refuse(f"{where}.{key}", "a non-empty string is required")
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
                raise _refuse(f"{where}.role", "must be one of user, system, developer, assistant")
            messages.append({"role": role, "content": _text(item.get("content"), f"{where}.content")})
            if role == "assistant":
                calling = messages[-1]
        else:
            raise _refuse(f"{where}.type", f"item type {kind!r} is not served here: message, function_call "
                          "and function_call_output items only (send the whole conversation as input)")  # fmt: skip
    if not messages:
        raise _refuse("input", "at least one item is required")
    return messages


def chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    if tools is None:
        return None
    out = []
    for i, tool in enumerate(tools):
        if tool.get("type") != "function":
            raise _refuse(
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
    raise _refuse("tool_choice", "must be 'none', 'auto', 'required' or {'type': 'function', 'name': ...}")


def chat_response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    form = (text or {}).get("format")
    if form is not None and not isinstance(form, dict):
        raise _refuse("text.format", "must be an object with a 'type'")
    if form is None or form.get("type") == "text":
        return None
    if form.get("type") == "json_object":
        return {"type": "json_object"}
    if form.get("type") == "json_schema":
        keys = ("name", "schema", "strict", "description")
        return {"type": "json_schema", "json_schema": {k: form[k] for k in keys if k in form}}
    raise _refuse("text.format.type", "must be 'text', 'json_object' or 'json_schema'")


def output_items(out: dict[str, Any]) -> tuple[list[dict[str, Any]], bool]:
    """(the Responses output items of a chat answer's first choice, whether it was cut at max tokens)."""
    choice = out["choices"][0]
    message, cut = choice["message"], choice["finish_reason"] == "length"
    calls = message.get("tool_calls") or []
    items: list[dict[str, Any]] = []
    if message.get("content") or not calls:
        logprobs = (choice.get("logprobs") or {}).get("content") or []
        part = {
            "type": "output_text",
            "text": message.get("content") or "",
            "annotations": [],
            "logprobs": logprobs,
        }
        items.append({"type": "message", "id": f"msg_{uuid.uuid4().hex[:24]}", "role": "assistant",
                      "status": "incomplete" if cut else "completed", "content": [part]})  # fmt: skip
    for call in calls:
        items.append({"type": "function_call", "id": f"fc_{uuid.uuid4().hex[:24]}", "call_id": call["id"],
                      "name": call["function"]["name"], "arguments": call["function"]["arguments"],
                      "status": "completed"})  # fmt: skip
    return items, cut


def response_object(out: dict[str, Any], request: dict[str, Any]) -> dict[str, Any]:
    """The Responses `Response` of a chat answer `out` to the call `request` (the Responses body)."""
    items, cut = output_items(out)
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
            emit(
                "response.output_item.added",
                output_index=index,
                item={**item, "status": "in_progress", "content": []},
            )
            part = item["content"][0]
            empty = {**part, "text": "", "logprobs": []}
            emit("response.content_part.added", **at, content_index=0, part=empty)
            emit(
                "response.output_text.delta",
                **at,
                content_index=0,
                delta=part["text"],
                logprobs=part["logprobs"],
            )
            emit(
                "response.output_text.done",
                **at,
                content_index=0,
                text=part["text"],
                logprobs=part["logprobs"],
            )
            emit("response.content_part.done", **at, content_index=0, part=part)
        else:
            emit(
                "response.output_item.added",
                output_index=index,
                item={**item, "status": "in_progress", "arguments": ""},
            )
            emit("response.function_call_arguments.delta", **at, delta=item["arguments"])
            emit(
                "response.function_call_arguments.done", **at, name=item["name"], arguments=item["arguments"]
            )
        emit("response.output_item.done", output_index=index, item=item)
    emit(f"response.{response['status']}", response=response)
    return events
