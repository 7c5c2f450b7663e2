"""An OpenEnv environment server as a multi-turn environment: the client side, in the rollout worker.

`OpenEnvServer` is one server (its action shape read once from `GET /schema`, one event loop thread
for its clients); `OpenEnvEnvironment` is one trajectory's WebSocket session. The model's turn is
the action's one text field, or for an MCP tools server a `<tool_call>` whose result is a "tool"
turn. Every call has the job's step time limit.
"""

from __future__ import annotations

import asyncio
import functools
import json
import re
import sys
import threading
import time
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

import httpx

from workers.environments.base import EnvironmentReferenceError, prompt_text

MAX_MESSAGE_MB = 8.0  # a larger answer from the server is an error, not a trajectory
TOOL_CALL = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.DOTALL)
TOOLS_PROMPT = (
    "You can call these tools. To call one, write "
    '<tool_call>{"name": "TOOL", "arguments": {...}}</tool_call> and nothing after it.\n'
)


class OpenEnvServer:
    alive = True  # not this worker's to restart

    def __init__(self, name: str, ws_url: str, timeout_s: float, socket_path: str | None = None) -> None:
        """`ws_url`: "ws://HOST:PORT"; `socket_path`: a Unix socket to reach it through instead."""
        self.name, self.ws_url, self.timeout_s, self.socket_path = name, ws_url, timeout_s, socket_path
        self.text_field, self.tools = action_shape(self._schema(), name)
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, name="tandem-openenv-loop", daemon=True).start()

    def _schema(self) -> dict[str, Any]:
        transport = httpx.HTTPTransport(uds=self.socket_path) if self.socket_path else None
        base = "http://localhost" if self.socket_path else self.ws_url.replace("ws", "http", 1)
        deadline = time.monotonic() + self.timeout_s  # for the whole answer: a server may drip it
        body = bytearray()
        try:
            with (
                httpx.Client(transport=transport, timeout=self.timeout_s, trust_env=False) as client,
                client.stream("GET", f"{base}/schema") as response,
            ):
                for chunk in response.iter_bytes():
                    body += chunk
                    if len(body) > MAX_MESSAGE_MB * 2**20:
                        raise EnvironmentReferenceError(
                            f"OpenEnv environment '{self.name}' answered GET /schema with more than "
                            f"{MAX_MESSAGE_MB:g} MB"
                        )
                    if time.monotonic() > deadline:
                        raise httpx.ReadTimeout("the answer did not end in time")
        except httpx.TimeoutException:
            raise EnvironmentReferenceError(
                f"OpenEnv environment '{self.name}' did not answer GET /schema within {self.timeout_s:g} s"
            ) from None
        except httpx.HTTPError as err:
            raise EnvironmentReferenceError(
                f"OpenEnv environment '{self.name}' could not be reached: {type(err).__name__}: {err}"
            ) from None
        try:
            schema = json.loads(body)
        except (ValueError, RecursionError):
            schema = None
        if (
            response.status_code != 200
            or not isinstance(schema, dict)
            or not isinstance(schema.get("action"), dict)
        ):
            raise EnvironmentReferenceError(
                f"OpenEnv environment '{self.name}' answered GET /schema with status {response.status_code} "
                "and no action schema: is it an OpenEnv server?"
            )
        return schema

    def new(self) -> OpenEnvEnvironment:
        return OpenEnvEnvironment(self)

    def client(self) -> Any:
        kwargs = {"connect_timeout_s": self.timeout_s, "message_timeout_s": self.timeout_s,
                  "max_message_size_mb": MAX_MESSAGE_MB}  # fmt: skip
        generic, unix = client_classes()
        if self.socket_path:
            return unix(self.socket_path, **kwargs)
        return generic(base_url=self.ws_url, **kwargs)

    def run(self, coroutine: Any, what: str) -> Any:
        """The coroutine's value, run on this server's loop; TimeoutError naming the environment."""
        future = asyncio.run_coroutine_threadsafe(coroutine, self.loop)
        try:
            return future.result(timeout=self.timeout_s + 1.0)  # the client's own limits come first
        except (FutureTimeout, asyncio.TimeoutError):
            future.cancel()
            raise TimeoutError(
                f"OpenEnv environment '{self.name}' did not answer {what} within {self.timeout_s:g} s"
            ) from None
        except Exception as err:  # its message is the server's, of any size
            raise RuntimeError(
                f"OpenEnv environment '{self.name}' failed {what}: {type(err).__name__}: {str(err)[:500]}"
            ) from None

    def release(self, envs: list[OpenEnvEnvironment]) -> None:
        """End these trajectories' sessions, all at once (one time limit for them together)."""
        clients = [env.client for env in envs if env.client is not None]
        for env in envs:
            env.client = None
        if clients:
            try:
                self.run(_close(clients), "close")
            except TimeoutError:
                pass  # the server may drop them itself; nothing of the job waits on it


class OpenEnvEnvironment:
    """One trajectory on an OpenEnv server: reset(row) and step(text) of base.py over its client."""

    def __init__(self, server: OpenEnvServer) -> None:
        self.server, self.client = server, None

    def reset(self, row: dict[str, Any]) -> list[dict[str, str]]:
        self.client = self.server.client()
        extra = row.get("extra") if isinstance(row.get("extra"), dict) else {}
        kwargs = {"prompt": row.get("prompt"), "ground_truth": row.get("ground_truth"), **extra}
        result = self.server.run(self.client.reset(**kwargs), "reset")
        text = observation_text(result.observation)
        messages = [{"role": "user", "content": text if text else prompt_text(row.get("prompt"))}]
        if self.server.tools:
            listed = self.server.run(self.client.step({"type": "list_tools"}), "list_tools")
            messages.insert(0, {"role": "system", "content": tools_text(listed.observation)})
        return messages

    def step(self, assistant_text: str) -> tuple[dict[str, str] | None, float, bool, dict[str, Any]]:
        if self.client is None:
            raise RuntimeError(f"OpenEnv environment '{self.server.name}': step before reset")
        if self.server.tools:
            call = tool_call(assistant_text)
            if call is None:
                return None, 0.0, True, {}  # a tools environment takes nothing but tool calls
            action: dict[str, Any] = {"type": "call_tool", "tool_name": call[0], "arguments": call[1]}
        else:
            action = {self.server.text_field: assistant_text}
        result = self.server.run(self.client.step(action), "step")
        reward = 0.0 if result.reward is None else float(result.reward)
        text = (tool_result_text if self.server.tools else observation_text)(result.observation)
        message = {"role": "tool" if self.server.tools else "user", "content": text} if text else None
        return message, reward, bool(result.done), {"tool_call": True} if self.server.tools else {}


async def _close(clients: list[Any]) -> None:
    await asyncio.gather(*(c.close() for c in clients), return_exceptions=True)


def action_shape(schema: dict[str, Any], name: str) -> tuple[str | None, bool]:
    """(the action's text field, whether it is a tools environment) from the server's schemas."""
    action = schema["action"]
    properties = action.get("properties") if isinstance(action.get("properties"), dict) else {}
    if {"tool_name", "arguments"} <= properties.keys():
        return None, True
    texts = [
        k
        for k, p in properties.items()
        if k != "metadata" and isinstance(p, dict) and p.get("type") == "string"
    ]
    required = [k for k in texts if k in _list(action.get("required"))]
    for candidates in (required, texts):
        if len(candidates) == 1:
            return candidates[0], False
    fields = sorted(k for k in properties if k != "metadata")
    raise EnvironmentReferenceError(
        f"OpenEnv environment '{name}': its action has fields {fields}; Tandem sends the model's turn "
        "as an action with one text field, or as an MCP tool call"
    )


def _list(value: Any) -> list:
    return value if isinstance(value, list) else []


def observation_text(observation: Any) -> str:
    """An observation as one turn's text: its one text field, else its JSON ('' when empty)."""
    if isinstance(observation, str):
        return observation
    if not isinstance(observation, dict) or not observation:
        return "" if observation is None or observation == {} else json.dumps(observation, default=str)
    texts = [v for v in observation.values() if isinstance(v, str)]
    if len(texts) == 1 and len(observation) == 1:
        return texts[0]
    return json.dumps(observation, sort_keys=True, ensure_ascii=False, default=str)


def tool_result_text(observation: Any) -> str:
    """A tool call's observation as the tool turn's text: the result's text content, or the error."""
    if not isinstance(observation, dict):
        return observation_text(observation)
    error = observation.get("error")
    if isinstance(error, dict):
        return f"error: {error.get('message', error)}"
    result = observation.get("result")
    content = result.get("content") if isinstance(result, dict) else None
    if isinstance(content, list):
        texts = [c.get("text") for c in content if isinstance(c, dict) and isinstance(c.get("text"), str)]
        if texts:
            return "\n".join(texts)
    return observation_text(result if result is not None else observation)


def tools_text(observation: Any) -> str:
    tools = observation.get("tools") if isinstance(observation, dict) else None
    if not isinstance(tools, list):
        raise ValueError(f"list_tools answered {type(observation).__name__}, not a list of tools")
    lines = [json.dumps({k: t.get(k) for k in ("name", "description", "input_schema")}) for t in tools
             if isinstance(t, dict)]  # fmt: skip
    return TOOLS_PROMPT + "\n".join(lines)


def tool_call(text: str) -> tuple[str, dict[str, Any]] | None:
    """(name, arguments) of the first well-formed `<tool_call>` in a turn, or None."""
    for match in TOOL_CALL.finditer(text):
        try:
            call = json.loads(match.group(1))
        except ValueError:
            continue
        name, arguments = call.get("name"), call.get("arguments", {})
        if isinstance(name, str) and isinstance(arguments, dict):
            return name, arguments
    return None


@functools.cache
def client_classes() -> tuple[type, type]:
    """OpenEnv's GenericEnvClient, and the same over a Unix socket (a server the job started)."""
    # openenv.core imports its Gradio web UI, which costs seconds and memory: kept out of this import.
    blocked = "gradio" not in sys.modules
    if blocked:
        sys.modules["gradio"] = None  # type: ignore[assignment]
    try:
        from openenv.core.generic_client import GenericEnvClient
    finally:
        if blocked:
            sys.modules.pop("gradio", None)
    from websockets.asyncio.client import unix_connect

    class UnixSocketEnvClient(GenericEnvClient):
        def __init__(self, path: str, **kwargs: Any) -> None:
            super().__init__(base_url="ws://localhost", **kwargs)
            self._socket_path = path

        async def connect(self) -> UnixSocketEnvClient:
            if self._ws is None:
                try:
                    self._ws = await unix_connect(self._socket_path, uri=self._ws_url,
                                                  open_timeout=self._connect_timeout, max_size=self._max_message_size)  # fmt: skip
                except Exception as err:
                    raise ConnectionError(f"could not connect to {self._socket_path}: {err}") from err
            return self

    return GenericEnvClient, UnixSocketEnvClient
