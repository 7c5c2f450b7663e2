"""The sandbox's side of `rollout.external.agent`: the user's agent gets an `openai.OpenAI` client (a
verifiers environment an `AsyncOpenAI` one) whose transport sends each request over the sandbox's pipe
to the AgentWorker that owns it, which has the job's endpoint answer: the agent reaches nothing else.
"""

from __future__ import annotations

import asyncio
import inspect
from typing import Any

import httpx

from workers.references import lookup_builtin, parse_reference, resolve_reference
from workers.sandbox.child import ask

REFERENCE_FORMS = "'module:function' or 'path/to/file.py:function'"
BUILTIN_AGENTS: dict[str, Any] = {}  # none yet: "builtin:..." names nothing an agent may be

CALL_TIMEOUT_S = 900.0
BASE_URL = "http://tandem-job/v1"  # any host: the transport never opens a connection
_agents: dict[str, Any] = {}


def _ask_parent(request: httpx.Request, body: bytes) -> dict[str, Any]:
    payload = {"method": request.method, "path": request.url.path, "body": body.decode("utf-8", "replace")}
    return ask("http", payload, CALL_TIMEOUT_S)


def _response(answer: dict[str, Any]) -> httpx.Response:
    return httpx.Response(int(answer["status"]), json=answer["json"], headers=answer.get("headers") or {})


class PipeTransport(httpx.BaseTransport):
    def handle_request(self, request: httpx.Request) -> httpx.Response:
        return _response(_ask_parent(request, request.read()))


class AsyncPipeTransport(httpx.AsyncBaseTransport):
    """The pipe's blocking wait runs in a thread."""

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        body = await request.aread()
        return _response(await asyncio.to_thread(_ask_parent, request, body))


def load_agent(ref: str, args: dict[str, Any] | None = None) -> Any:
    """The agent function `ref` names, or its verifiers environment built with `args` and its first
    task read (so a taskset that cannot load fails at the job's start); cached."""
    from controller.verifiers_agent import VerifiersAgent, is_taskset

    if ref not in _agents:
        agent = load_agent_fn(ref)
        if is_taskset(agent):
            agent = VerifiersAgent(ref, agent, args)
            agent.task(0)
        elif args is not None:
            raise AgentError(f"agent '{ref}' is a function: rollout.external.agent_args are the arguments of "
                             "a verifiers environment's Taskset only")  # fmt: skip
        _agents[ref] = agent
    return _agents[ref]


def check_agent(ref: str, args: dict[str, Any] | None = None) -> bool:
    load_agent(ref, args)
    return True


def run_in_sandbox(ref: str, model: str, index: int, args: dict[str, Any] | None = None) -> dict[str, Any]:
    from openai import OpenAI

    from controller.verifiers_agent import VerifiersAgent

    agent = load_agent(ref, args)
    if isinstance(agent, VerifiersAgent):
        out = asyncio.run(_verifiers_call(agent, model, index))
    else:
        client = OpenAI(base_url=BASE_URL, api_key="in-job", max_retries=10,
                        http_client=httpx.Client(transport=PipeTransport()))  # fmt: skip
        out = agent(client, model, index)
    result = out if isinstance(out, dict) else {"reward": out}
    return {"reward": float(result["reward"]),
            **{k: result[k] for k in ("task_id", "turn_rewards", "metadata") if k in result}}  # fmt: skip


async def _verifiers_call(agent: Any, model: str, index: int) -> dict[str, Any]:
    from openai import AsyncOpenAI

    async with AsyncOpenAI(base_url=BASE_URL, api_key="in-job", max_retries=10,
                           http_client=httpx.AsyncClient(transport=AsyncPipeTransport())) as client:  # fmt: skip
        return await agent.rollout(client, model, index)


class AgentError(ValueError):
    """An agent reference that does not resolve to a usable function."""


def load_agent_fn(ref: str) -> Any:
    """The function (or verifiers Taskset class) `ref` names; AgentError says why not."""
    if parse_reference(ref, "agent", REFERENCE_FORMS, AgentError).form == "builtin":
        return lookup_builtin(ref, BUILTIN_AGENTS, "agent", AgentError)
    fn = resolve_reference(ref, "agent", AgentError)
    from controller.verifiers_agent import is_taskset  # a verifiers environment (imports no verifiers)

    if is_taskset(fn):
        return fn
    if inspect.isclass(fn) or not callable(fn):
        raise AgentError(f"agent '{ref}' is not a function (type {type(fn).__name__})")
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # no signature to read (a C function): not an agent of ours
        raise AgentError(
            f"agent '{ref}' has no readable signature; expected (client, model, index)"
        ) from None
    try:
        signature.bind("client", "model", 0)
    except TypeError:
        raise AgentError(
            f"agent '{ref}' has signature {signature}; expected (client, model, index)"
        ) from None
    return fn
