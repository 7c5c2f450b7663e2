"""The sandbox's side of `rollout.external.agent` (controller/external_agents.py runs the parent's).

`run_in_sandbox` calls the user's agent function with an `openai.OpenAI` client whose httpx
transport (`PipeTransport`) sends each request over the sandbox's pipe to the AgentWorker that owns
the sandbox, which has the job's endpoint answer it over Ray. So an agent reaches its job's model
and nothing else: the sandbox has no network. `load_agent_fn` resolves and checks the reference
(also at submission, in a child process: controller/user_code.py).
"""

from __future__ import annotations

import inspect
from typing import Any

import httpx

from workers.references import lookup_builtin, parse_reference, resolve_reference
from workers.sandbox.child import ask

REFERENCE_FORMS = "'module:function' or 'path/to/file.py:function'"
BUILTIN_AGENTS: dict[str, Any] = {}  # none yet: "builtin:..." names nothing an agent may be

CALL_TIMEOUT_S = 900.0
_functions: dict[str, Any] = {}


class PipeTransport(httpx.BaseTransport):
    """Requests out as plain data to the sandbox's parent; its answers back as responses."""

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        payload = {
            "method": request.method,
            "path": request.url.path,
            "body": request.read().decode("utf-8", "replace"),
        }
        answer = ask("http", payload, CALL_TIMEOUT_S)
        return httpx.Response(int(answer["status"]), json=answer["json"], headers=answer.get("headers") or {})


def run_in_sandbox(ref: str, model: str, index: int) -> dict[str, Any]:
    """One agent call: the user's function with a client of the job's endpoint; its result, plain."""
    from openai import OpenAI

    if ref not in _functions:
        _functions[ref] = load_agent_fn(ref)
    client = OpenAI(base_url="http://tandem-job/v1", api_key="in-job", max_retries=10,
                    http_client=httpx.Client(transport=PipeTransport()))  # fmt: skip
    out = _functions[ref](client, model, index)
    result = out if isinstance(out, dict) else {"reward": out}
    return {"reward": float(result["reward"]),
            **{k: result[k] for k in ("task_id", "turn_rewards", "metadata") if k in result}}  # fmt: skip


class AgentError(ValueError):
    """An agent reference that does not resolve to a usable function."""


def load_agent_fn(ref: str) -> Any:
    """The function `ref` names ('module:function' or 'path/file.py:function'); AgentError says why not.
    (controller/user_code.py runs it in a child process when a job is submitted.)"""
    if parse_reference(ref, "agent", REFERENCE_FORMS, AgentError).form == "builtin":
        return lookup_builtin(ref, BUILTIN_AGENTS, "agent", AgentError)
    fn = resolve_reference(ref, "agent", AgentError)
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
