"""Checking and running user code (reward functions, environments, agents) for the API: in a sandbox.

Importing a user's module runs arbitrary code, so the API never does: `check_callable` looks a
'builtin:' up here and has any other reference loaded in a sandbox the way the job will load it;
`run_sandboxed` calls service code on a user's reference there.
"""

from __future__ import annotations

import pkgutil
import subprocess
from typing import Any

from workers.environments.openenv_ref import is_openenv_url, openenv_url_problem
from workers.references import BUILTIN_PREFIX, lookup_builtin
from workers.sandbox.channel import UserCode
from workers.sandbox.launch import SandboxUnavailable
from workers.sandbox.limits import Limits

# kind -> (its name in messages, its loader, its built-ins' table), the last two as "module:attribute"
KINDS: dict[str, tuple[str, str, str]] = {
    "reward": ("reward function", "controller.rewards:load_reward_fn", "controller.rewards:BUILTIN_REWARDS"),
    "environment": (
        "environment",
        "workers.environments.base:load_environment_class",
        "workers.environments:BUILTIN_ENVIRONMENTS",
    ),
    "agent": ("agent", "controller.agent_sandbox:load_agent_fn", "controller.agent_sandbox:BUILTIN_AGENTS"),
}
DEFAULT_TIMEOUT_S = 30.0


class UserCodeError(ValueError):
    """User code that failed, hung or ended its process; the message says which and why."""


class UserCodeRefused(UserCodeError):
    """User code this service does not run at all: no sandbox here, and no single-user flag."""


def check_callable(ref: str, kind: str, timeout_s: float = DEFAULT_TIMEOUT_S, limits: Limits | None = None,
                   allow_unsandboxed: bool | None = None) -> str | None:  # fmt: skip
    """Why `ref` is not a usable `kind`, or None when it is. UserCodeRefused when no sandbox can run."""
    if kind not in KINDS:
        raise KeyError(f"unknown kind of user code {kind!r}; known: {sorted(KINDS)}")
    if kind == "environment" and is_openenv_url(ref):  # an address, not code: checked here
        return openenv_url_problem(ref)
    what = KINDS[kind][0]
    try:
        if ref.startswith(BUILTIN_PREFIX):  # the service's own code: looked up in-process
            lookup_builtin(ref, pkgutil.resolve_name(KINDS[kind][2]), what, ValueError)
        else:
            run_sandboxed("controller.user_code:check_here", ref, [kind], timeout_s, f"{what} '{ref}'", limits,
                          allow_unsandboxed)  # fmt: skip
    except UserCodeRefused:
        raise
    except ValueError as err:
        return str(err)
    return None


def check_here(ref: str, kind: str) -> bool:
    """The sandbox's side of `check_callable`."""
    pkgutil.resolve_name(KINDS[kind][1])(ref)
    return True


def run_sandboxed(target: str, ref: str, args: list[Any], timeout_s: float, what: str,
                  limits: Limits | None = None, allow_unsandboxed: bool | None = None) -> Any:  # fmt: skip
    """`target(ref, *args)` in a fresh sandbox holding `ref`'s file (if any); its plain-data value, or
    UserCodeError saying what went wrong."""
    try:
        limits = limits or Limits.from_env()
        code = UserCode(ref, what, UserCodeError, target, args, timeout_s, limits, subprocess.DEVNULL,
                        allow_unsandboxed=allow_unsandboxed)  # fmt: skip
    except SandboxUnavailable as err:
        raise UserCodeRefused(str(err)) from None
    code.close()
    return code.checked
