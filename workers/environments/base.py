"""The environment interface of multi-turn rollouts: the one place it is written down.

A job with `rollout.environment` set samples trajectories instead of single responses. An
environment is a plain Python class, constructed with no arguments once per trajectory, with two
methods:

    reset(row: dict) -> observation
        `row` is the data row: {"prompt": the row's prompt (string or chat messages),
        "ground_truth": ..., "extra": dict | None}. The observation becomes the conversation's
        first turn(s).

    step(assistant_text: str) -> (observation | None, reward: float, done: bool, info: dict)
        Called with the text of the model's latest turn (special tokens removed). The observation
        (None when there is nothing to say) is appended as the next turn unless `done`. Rewards of
        all steps add up to the trajectory's score, which the advantage estimator uses.
        `info` may carry numbers; `info["tool_call"] = True` counts a tool call.

An observation is a string (one "user" turn), a message {"role": ..., "content": ...}, or a list
of messages; a tool's output is a message with role "tool". Everything is rendered through the
model's chat template, so the tokenizer must have one.

Steps of all live trajectories of a worker run concurrently in a thread pool; each step has a time
limit (`rollout.env_step_timeout_s`). A step (or reset) that raises or times out ends its
trajectory with score 0; it is counted in the metrics ("multiturn/env_errors",
"multiturn/env_timeouts") and the job goes on. A trajectory also ends when it reaches
`rollout.max_turns` assistant turns or its token budget `rollout.max_response_tokens` (all tokens
after the first prompt: sampled and observation); those are marked by their finish reason
("max_turns", "budget") and counted as truncated.

References: "builtin:NAME" (see workers/environments/__init__.py), "package.module:Class", or
"path/to/file.py:Class". examples/my_env.py is a complete user environment.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

Message = dict[str, str]
Observation = str | Message | list[Message]


@runtime_checkable
class Environment(Protocol):
    """What a multi-turn job needs of an environment class's instances."""

    def reset(self, row: dict[str, Any]) -> Observation: ...

    def step(self, assistant_text: str) -> tuple[Observation | None, float, bool, dict[str, Any]]: ...


class EnvironmentContractError(RuntimeError):
    """An environment returned something outside the interface (raised inside the worker)."""


@dataclass
class StepResult:
    """A validated `step` return value."""

    messages: list[Message]
    reward: float
    done: bool
    info: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_return(cls, value: Any) -> StepResult:
        if not (isinstance(value, tuple) and len(value) == 4):
            raise EnvironmentContractError(
                f"step() must return (observation | None, reward, done, info), got {type(value).__name__}"
            )
        observation, reward, done, info = value
        try:
            reward = float(reward)
        except (TypeError, ValueError):
            raise EnvironmentContractError(
                f"step() returned a reward that is not a number: {reward!r}"
            ) from None
        messages = [] if observation is None else as_messages(observation, default_role="user")
        return cls(messages, reward, bool(done), info if isinstance(info, dict) else {})


def as_messages(observation: Observation, default_role: str = "user") -> list[Message]:
    """An observation as a list of chat messages; raises EnvironmentContractError on anything else."""
    if isinstance(observation, str):
        return [{"role": default_role, "content": observation}]
    if isinstance(observation, dict):
        observation = [observation]
    if isinstance(observation, list) and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
        for m in observation
    ):
        return [{"role": m["role"], "content": m["content"]} for m in observation]
    raise EnvironmentContractError(
        "an observation must be a string, a message {'role', 'content'} or a list of messages, "
        f"got {type(observation).__name__}"
    )
