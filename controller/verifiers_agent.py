"""A verifiers environment as the agent of a job (`rollout.external.agent` naming a `vf.Taskset`).

verifiers' harnesses install runtimes over the network, which a sandbox cannot, so Tandem plays its
tool-less `null` harness: each call sends its task's prompt to the job's endpoint, records the reply in
a `vf.Trace` and scores it with the task's own rubric. `agent_args` are the taskset config's fields
(`sampling`: verifiers' SamplingConfig). Runs only in a sandbox.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Iterator
from typing import Any

from controller.agent_sandbox import AgentError

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
