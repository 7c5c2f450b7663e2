"""The environment interface of multi-turn rollouts (the one place it is written down), and how a
reference becomes a class that meets it (`load_environment_class`).

An environment is a plain class, constructed with no arguments once per trajectory:

    reset(row: dict) -> observation
        row = {"prompt": string or chat messages, "ground_truth": ..., "extra": dict | None};
        the observation is the conversation's first turn(s).

    step(assistant_text: str) -> (observation | None, reward: float, done: bool, info: dict)
        Called with the model's latest turn (special tokens removed); the observation is appended
        unless `done`. Rewards add up to the trajectory's score; `info["tool_call"] = True` counts
        a tool call.

An observation is a string (one "user" turn), a message {"role", "content"} or a list of them (a
tool's output: role "tool"; roles are ROLES), rendered through the model's chat template. Steps run
concurrently, each within `rollout.env_step_timeout_s`; one that raises, times out or answers outside
this interface (a reward beyond ±MAX_ABS_REWARD, a first observation of no messages) ends its
trajectory with score 0 and the job goes on. A trajectory also ends at `rollout.max_turns` or its token budget
`rollout.max_response_tokens` (counted as truncated). References: "builtin:NAME",
"package.module:Class" or "path/to/file.py:Class"; examples/my_env.py is a complete one. The API
checks a reference in a sandbox at submission (controller/user_code.py), workers again.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any

from schema.openai_bodies import MAX_ABS_REWARD
from workers.environments.openenv_ref import is_openenv_app
from workers.references import load_reference

Message = dict[str, str]
Observation = str | Message | list[Message]
ROLES = ("system", "user", "assistant", "tool")  # what chat templates render; others they drop or refuse
REFERENCE_FORMS = "'builtin:NAME', 'module:Class' or 'path/to/file.py:Class'"


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
        if not abs(reward) <= MAX_ABS_REWARD:  # NaN, inf, or inf once in float32: the advantages
            raise EnvironmentContractError(
                f"step() returned a reward that is not a number within ±{MAX_ABS_REWARD:g}: {reward!r}"
            )
        messages = [] if observation is None else as_messages(observation, default_role="user")
        return cls(messages, reward, bool(done), info if isinstance(info, dict) else {})


def as_messages(observation: Observation, default_role: str = "user") -> list[Message]:
    """An observation as a list of chat messages; raises EnvironmentContractError on anything else."""
    if isinstance(observation, str):
        return [{"role": default_role, "content": observation}]
    if isinstance(observation, dict):
        observation = [observation]
    if isinstance(observation, list) and all(
        isinstance(m, dict) and m.get("role") in ROLES and isinstance(m.get("content"), str)
        for m in observation
    ):
        return [{"role": str(m["role"]), "content": str(m["content"])} for m in observation]
    raise EnvironmentContractError(
        "an observation must be a string, a message {'role', 'content'} or a list of messages, with "
        f"roles {', '.join(ROLES)} and string contents; got {_shape(observation)}"
    )


def _shape(observation: Any) -> str:
    if isinstance(observation, list):
        bad = next((m for m in observation if not (isinstance(m, dict) and m.get("role") in ROLES)), None)
        if isinstance(bad, dict):
            return f"a message with role {str(bad.get('role'))[:50]!r}"
    return type(observation).__name__


def prompt_text(prompt: Any) -> str:
    """A row's prompt as one turn's text: a string, or the last message's content."""
    if isinstance(prompt, list) and prompt and isinstance(prompt[-1], dict):
        return str(prompt[-1].get("content", ""))
    return "" if prompt is None else str(prompt)


class EnvironmentReferenceError(ValueError):
    """A reference that does not resolve to a usable environment class."""


def load_environment_class(ref: str) -> Any:
    """The class (or OpenEnv server app) `ref` names, validated; EnvironmentReferenceError says why not."""
    from workers.environments import BUILTIN_ENVIRONMENTS

    target = load_reference(
        ref, "environment", REFERENCE_FORMS, EnvironmentReferenceError, BUILTIN_ENVIRONMENTS
    )
    if not is_openenv_app(target):
        check_environment_class(ref, target)
    return target


def check_environment_class(ref: str, cls: Any) -> None:
    if not inspect.isclass(cls):
        raise EnvironmentReferenceError(f"environment '{ref}' is not a class ({type(cls).__name__})")
    try:
        inspect.signature(cls).bind()
    except TypeError:
        raise EnvironmentReferenceError(
            f"environment '{ref}' must be constructible without arguments: {cls.__name__}"
            f"{inspect.signature(cls)}"
        ) from None
    except ValueError:  # no signature to inspect (a builtin type): let construction decide
        pass
    for method in ("reset", "step"):
        fn = getattr(cls, method, None)
        if not callable(fn):
            raise EnvironmentReferenceError(f"environment '{ref}' has no method {method}()")
        try:
            inspect.signature(fn).bind(None, None)  # (self, argument)
        except TypeError:
            raise EnvironmentReferenceError(
                f"environment '{ref}': {method}{inspect.signature(fn)} must accept one argument "
                f"after self ({'row' if method == 'reset' else 'assistant_text'})"
            ) from None
