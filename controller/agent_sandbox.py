"""The sandbox's side of `rollout.external.agent`: the user's agent gets an `openai.OpenAI` client (a
verifiers environment an `AsyncOpenAI` one) whose transport sends each request over the sandbox's pipe
to the AgentWorker that owns it, which has the job's endpoint answer: the agent reaches nothing else.

A verifiers environment (`rollout.external.agent` naming a `vf.Taskset`) runs as verifiers' tool-less
`null` harness would (its harnesses install runtimes over the network, which a sandbox cannot): each
call sends its task's prompt to the endpoint, records the reply in a `vf.Trace` and scores it with the
task's own rubric; `agent_args` are the taskset config's fields (`sampling`: verifiers' SamplingConfig).
"""

from __future__ import annotations

import asyncio
import inspect
import sys
from collections.abc import Iterator
from typing import Any

import httpx

from workers.references import check_function, load_reference
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
    fn = load_reference(ref, "agent", REFERENCE_FORMS, AgentError, BUILTIN_AGENTS)
    if is_taskset(fn):
        return fn
    return check_function(ref, fn, "agent", AgentError, ("client", "model", "index"), trust_unreadable=False)


MAX_TASK_INDEX = 1 << 20  # an infinite taskset is read this far at most
SAMPLING_KEYS = ("temperature", "top_p", "max_tokens", "reasoning_effort")  # the rest go as extra_body


def is_taskset(obj: Any) -> bool:
    """Whether `obj` is a verifiers Taskset class (importing nothing: its module imported verifiers)."""
    module = sys.modules.get("verifiers.v1.taskset")
    return module is not None and inspect.isclass(obj) and issubclass(obj, module.Taskset)


class VerifiersAgent:
    """One taskset with its arguments, its tasks read as far as the calls' indices reach."""

    def __init__(self, ref: str, cls: type, args: dict[str, Any] | None) -> None:
        from pydantic import ValidationError
        from verifiers.v1 import SamplingConfig, Taskset, TasksetConfig
        from verifiers.v1.utils.generic import concrete_type

        self.ref, args = ref, dict(args or {})
        config_cls = concrete_type(cls, TasksetConfig, origin=Taskset) or TasksetConfig
        try:
            sampling = SamplingConfig.model_validate(args.pop("sampling", None) or {})
        except ValidationError as err:
            raise AgentError(f"verifiers environment '{ref}': rollout.external.agent_args.sampling: "
                             f"{_errors(err)}") from None  # fmt: skip
        self.sampling = sampling.model_dump(exclude_none=True)
        try:
            config = config_cls.model_validate({"id": ref.rpartition(":")[2], **args})
        except ValidationError as err:
            raise AgentError(f"verifiers environment '{ref}': rollout.external.agent_args do not fit its "
                             f"{config_cls.__name__}: {_errors(err)}") from None  # fmt: skip
        self.check_task_type(cls.task_type(), config)
        self.taskset = cls(config)
        self._tasks: list[Any] = []
        self._source: Iterator[Any] = iter(self.taskset)
        self._exhausted = False

    def check_task_type(self, task_cls: type, config: Any) -> None:
        why = None
        if task_cls.NEEDS_CONTAINER:
            why = f"its tasks ({task_cls.__name__}) need a container runtime"
        elif task_cls.toolsets(config.task):
            why = f"its tasks ({task_cls.__name__}) need tool servers"
        elif config.task.judges:
            why = "its tasks are scored by judges, which call other models"
        if why is not None:
            raise AgentError(f"verifiers environment '{self.ref}' cannot run in a job: {why}; "
                             "Tandem runs tool-less chat tasks scored by their own rewards")  # fmt: skip

    def task(self, index: int) -> Any:
        """The taskset's tasks in order, from the first again after its last."""
        while not self._exhausted and len(self._tasks) <= index and len(self._tasks) < MAX_TASK_INDEX:
            task = next(self._source, None)
            if task is None:
                self._exhausted = True
            else:
                self._tasks.append(task)
        if not self._tasks:
            raise AgentError(f"verifiers environment '{self.ref}' has no tasks")
        return self._tasks[index % len(self._tasks)]

    async def rollout(self, client: Any, model: str, index: int) -> dict[str, Any]:
        from verifiers.v1 import AgentConfig, AssistantMessage, MessageNode, SystemMessage, Trace, UserMessage
        from verifiers.v1.dialects.chat import message_to_wire
        from verifiers.v1.trace import AgentInfo, ModelCall, TraceTask

        task = self.task(index)
        data = task.data
        trace = Trace(task=TraceTask(type=type(task).__name__, data=data, key=task.key, hash=task.hash),
                      agent=AgentInfo(config=AgentConfig()))  # fmt: skip
        prompt = (
            [UserMessage(content=data.prompt)] if isinstance(data.prompt, str) else list(data.prompt or [])
        )
        if data.system_prompt:
            prompt.insert(0, SystemMessage(content=data.system_prompt))
        known = {k: v for k, v in self.sampling.items() if k in SAMPLING_KEYS}
        extra = {k: v for k, v in self.sampling.items() if k not in SAMPLING_KEYS}
        reply = await client.chat.completions.create(model=model, messages=[message_to_wire(m) for m in prompt],
                                                     extra_body=extra or None, **known)  # fmt: skip
        choice = reply.choices[0]
        for k, message in enumerate(prompt):
            trace.nodes.append(MessageNode(parent=k - 1 if k else None, message=message))
        trace.nodes.append(MessageNode(parent=len(prompt) - 1 if prompt else None, sampled=True,
                                       message=AssistantMessage(content=choice.message.content or "")))  # fmt: skip
        trace.calls.append(
            ModelCall(node=len(trace.nodes) - 1, model=model, finish_reason=choice.finish_reason)
        )
        trace.is_completed = trace.ok = True
        await task.score(trace)
        return {
            "reward": trace.reward,
            "task_id": f"{data.idx}-{task.key[:16]}",
            "metadata": {"rewards": {k: r.score for k, r in trace.rewards.items() if r is not None},
                         "metrics": {k: v for k, v in trace.metrics.items() if v is not None}},
        }  # fmt: skip


def _errors(err: Any) -> str:
    return "; ".join(f"{'.'.join(map(str, e['loc'])) or '(root)'}: {e['msg']}" for e in err.errors()[:5])
