"""Conversations through the model's chat template, token-exact: multi-turn rollouts and OpenAI chat
requests inside a job.

Sampled tokens are never decoded and re-encoded: a trajectory is the first prompt, each turn's sampled
tokens, and each observation's delta (`ChatDelta`). A probe [user, assistant MARKER] rendered once gives
the template's assistant suffix (its first special token is the turn-end token); an observation's delta
is the part of that suffix the sampled tokens did not produce, then the rendering after the probe.
`ChatRenderer` adds OpenAI's shapes: a template that does not render `tools` gets them in the system
message, Hermes/Qwen style, and tool calls are `<tool_call>{"name", "arguments"}</tool_call>` both ways.
"""

from __future__ import annotations

import json
import re
from typing import Any

TOOL_CALL_END = "</tool_call>"
_TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
TOOLS_HEADER = (
    "# Tools\nYou may call functions. Their signatures, within <tools></tools>:\n<tools>\n{tools}\n</tools>\n"
    'Call one as <tool_call>{{"name": <name>, "arguments": <object>}}</tool_call>'
)
_MARKER = "\u2063TANDEM\u2063"  # invisible separators: cannot occur in a real message
_PROBE = [{"role": "user", "content": "u"}, {"role": "assistant", "content": _MARKER}]


class ChatDelta:
    def __init__(self, tokenizer: Any) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError(
                "multi-turn rollouts render turns through the chat template, and this model's tokenizer "
                "has none: use a chat model (e.g. model.builtin 'tiny-qwen2-chat') or add a chat_template"
            )
        self.tokenizer = tokenizer
        self._probe = self._render(_PROBE, generation_prompt=False)
        self.assistant_suffix = self._probe[self._probe.index(_MARKER) + len(_MARKER) :]
        suffix_ids = self.encode(self.assistant_suffix)
        special = set(tokenizer.all_special_ids)
        self.turn_end_id: int | None = suffix_ids[0] if suffix_ids and suffix_ids[0] in special else None
        end_text = tokenizer.decode([self.turn_end_id]) if self.turn_end_id is not None else ""
        self._suffix_after_end = self.assistant_suffix[len(end_text) :]

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def _render(self, messages: list[dict[str, str]], generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=generation_prompt, tokenize=False
        )

    def prompt_ids(self, messages: list[dict[str, str]]) -> list[int]:
        return self.encode(self._render(messages, generation_prompt=True))

    def observation_ids(self, messages: list[dict[str, str]], last_sampled: int | None) -> list[int]:
        """The delta that closes the assistant turn (ended by `last_sampled`) and adds `messages`."""
        full = self._render(_PROBE + messages, generation_prompt=True)
        if not full.startswith(self._probe):
            raise ValueError("the chat template renders a conversation's prefix differently once it grows")
        ended = self.turn_end_id is not None and last_sampled == self.turn_end_id
        suffix = self._suffix_after_end if ended else self.assistant_suffix
        return self.encode(suffix + full[len(self._probe) :])

    def assistant_text(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        """The text of a sampled turn, without the turn-end token that closed it."""
        if token_ids and token_ids[-1] == self.turn_end_id:
            token_ids = token_ids[:-1]
        return self.tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)


def content_text(content: Any) -> str:
    """A message's content as text: a string, None, or a list of text parts (others are refused)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts = []
    for part in content:
        if part.get("type") != "text":
            raise ValueError(f"content part of type '{part.get('type')}' is not supported: text only")
        parts.append(part.get("text", ""))
    return "".join(parts)


def parsed_arguments(arguments: Any) -> Any:
    """A tool call's arguments as an object when they are a JSON string, else as they are."""
    try:
        return json.loads(arguments) if isinstance(arguments, str) else arguments
    except json.JSONDecodeError:
        return arguments


def tool_call_text(call: dict[str, Any]) -> str:
    function = call.get("function", {})
    arguments = parsed_arguments(function.get("arguments", "{}"))
    return "<tool_call>" + json.dumps({"name": function.get("name"), "arguments": arguments}) + "</tool_call>"


def parse_tool_calls(text: str, call_id: str) -> tuple[str, list[dict[str, Any]]]:
    """(content without the tool-call blocks, OpenAI tool_calls). A block that is not JSON with a
    'name' stays in the content, as the model wrote it."""
    calls: list[dict[str, Any]] = []

    def take(match: re.Match) -> str:
        try:
            body = json.loads(match.group(1))
        except json.JSONDecodeError:
            return match.group(0)
        if not isinstance(body, dict) or not isinstance(body.get("name"), str):
            return match.group(0)
        arguments = body.get("arguments", {})
        arguments = arguments if isinstance(arguments, str) else json.dumps(arguments)
        function = {"name": body["name"], "arguments": arguments}
        calls.append({"id": f"{call_id}_{len(calls)}", "type": "function", "function": function})
        return ""

    content = _TOOL_CALL.sub(take, text)
    return (content.strip() if calls else content), calls


def with_tools_header(messages: list[dict[str, Any]], tools: list[dict]) -> list[dict[str, Any]]:
    """The messages with the tool schemas in the system message (Hermes/Qwen convention), for a
    template that does not render `tools` itself."""
    header = TOOLS_HEADER.format(tools="\n".join(json.dumps(t, sort_keys=True) for t in tools))
    if messages and messages[0]["role"] == "system":
        return [{**messages[0], "content": messages[0]["content"] + "\n\n" + header}, *messages[1:]]
    return [{"role": "system", "content": header}, *messages]


class ChatRenderer(ChatDelta):
    def __init__(self, tokenizer: Any) -> None:
        super().__init__(tokenizer)
        template = tokenizer.chat_template if isinstance(tokenizer.chat_template, str) else ""
        self.native_tools = "tools" in template
        self.native_tool_calls = "tool_calls" in template

    def messages(self, messages: list[dict[str, Any]], tools: list[dict] | None = None) -> list[dict]:
        """The template's messages: text contents, tool calls as the template (or Hermes) wants."""
        out = []
        for m in messages:
            msg: dict[str, Any] = {"role": m["role"], "content": content_text(m.get("content"))}
            calls = m.get("tool_calls") or []
            if calls and self.native_tool_calls:
                msg["tool_calls"] = [_native_call(c) for c in calls]
            elif calls:
                msg["content"] = "".join([msg["content"], *(tool_call_text(c) for c in calls)])
            if m.get("tool_call_id") and self.native_tool_calls:
                msg["tool_call_id"] = m["tool_call_id"]
            out.append(msg)
        if tools and not self.native_tools:
            return with_tools_header(out, tools)
        return out

    def prompt_ids(self, messages: list[dict[str, Any]], tools: list[dict] | None = None) -> list[int]:
        rendered = self.messages(messages, tools)
        if tools and self.native_tools:
            text = self.tokenizer.apply_chat_template(
                rendered, tools=tools, add_generation_prompt=True, tokenize=False
            )
            return self.encode(text)
        return super().prompt_ids(rendered)

    def delta_ids(self, added: list[dict[str, Any]], last_sampled: int | None) -> list[int]:
        """The tokens that close the last assistant turn and add `added` (then the generation prompt)."""
        return self.observation_ids(self.messages(added), last_sampled)

    def reply(self, sampled: list[int], call_id: str, parse_tools: bool) -> dict[str, Any]:
        """The assistant message of sampled tokens: content decoded from them, tool calls parsed."""
        text = self.assistant_text(sampled)
        if not parse_tools:
            return {"role": "assistant", "content": text, "tool_calls": []}
        content, calls = parse_tool_calls(text, call_id)
        return {"role": "assistant", "content": content, "tool_calls": calls}

    def token_texts(self, ids: list[int]) -> list[str]:
        return [self.tokenizer.decode([i]) for i in ids]


def _native_call(call: dict[str, Any]) -> dict[str, Any]:
    function = dict(call.get("function", {}))
    function["arguments"] = parsed_arguments(function.get("arguments", "{}"))
    return {"type": "function", "id": call.get("id"), "function": function}


def cut_at_stop(text_of: Any, ids: list[int], stops: list[str]) -> tuple[list[int], bool]:
    """(the sampled ids up to the token that completes the first stop string, whether one did).
    A prefix's text only grows, so the shortest one holding a stop is bisected: O(log n) decodes, not
    one per token (which, on a long reply, held the endpoint's event loop for minutes)."""
    holds = lambda end: any(s in text_of(ids[:end]) for s in stops)  # noqa: E731
    if not stops or not holds(len(ids)):
        return ids, False
    low, high = 1, len(ids)  # holds(high); the answer is the least such end
    while low < high:
        mid = (low + high) // 2
        low, high = (low, mid) if holds(mid) else (mid + 1, high)
    return ids[:high], True


def strip_stop(text: str, stops: list[str]) -> str:
    """The text before the first stop string (OpenAI's content leaves the stop string out)."""
    cut = min((text.index(s) for s in stops if s in text), default=len(text))
    return text[:cut]
