"""User environments run in a sandbox; a worker's multi-turn rollouts step them through proxies.

`environment_factory(config)` gives a built-in's class, or the `new` of a host: one long-lived
sandbox per reference in this worker process, replaced after its process died or a step overran.
An OpenEnv app a reference names is served from a sandbox with no network, on a Unix socket this
worker binds and hands in. The `host_*` functions and `serve_app` are the sandbox's side.
"""

from __future__ import annotations

import itertools
import shutil
import socket
import tempfile
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from schema.workers import EnvironmentConfig
from workers.environments.base import REFERENCE_FORMS, EnvironmentReferenceError, load_environment_class
from workers.environments.openenv_client import OpenEnvEnvironment, OpenEnvServer
from workers.environments.openenv_ref import is_openenv_app, is_openenv_url, openenv_ws_url
from workers.references import parse_reference
from workers.sandbox.channel import SandboxError, SandboxTimeout, UserCode
from workers.sandbox.limits import Limits

HOST = "workers.environments.sandboxed"
START_TIMEOUT_S = 120.0  # importing an OpenEnv app (FastAPI, the user's packages) and starting it
BACKLOG = 256
GRACE_S = 5.0  # past the rollout's own step limit, before a call stops waiting
_hosts: dict[str, EnvironmentHost | OpenEnvHost | OpenEnvServer] = {}  # by reference, "openenv:URL" too
_hosts_lock = threading.Lock()


def environment_factory(config: EnvironmentConfig) -> Any:
    """What makes one environment of `config.environment`: a built-in class, or a host's `new`."""
    ref = config.environment
    if not is_openenv_url(ref):
        parsed = parse_reference(ref, "environment", REFERENCE_FORMS, EnvironmentReferenceError)
        if parsed.form == "builtin":
            return load_environment_class(ref)
    with _hosts_lock:
        host = _hosts.get(ref)
        if host is None or not host.alive:
            _hosts[ref] = host = _start(ref, config)
    return host.new


def _start(ref: str, config: EnvironmentConfig) -> EnvironmentHost | OpenEnvHost | OpenEnvServer:
    if is_openenv_url(ref):  # checked again here: the cluster as this worker sees it
        try:
            url = openenv_ws_url(ref)
        except ValueError as err:
            raise EnvironmentReferenceError(str(err)) from None
        return OpenEnvServer(ref, url, config.env_step_timeout_s)
    host = EnvironmentHost(ref, config)
    if host.checked != "openenv":
        return host
    host.close()  # an app's server needs a socket handed to its sandbox at the start
    return OpenEnvHost(ref, config)


def release(envs: list[Any]) -> None:
    """Drop a finished batch's environments from their sandboxes and servers (one call for each)."""
    groups: dict[EnvironmentHost | OpenEnvServer, list[Any]] = {}
    for env in envs:
        if isinstance(env, RemoteEnvironment | OpenEnvEnvironment):
            groups.setdefault(env.host if isinstance(env, RemoteEnvironment) else env.server, []).append(env)
    for owner, group in groups.items():
        owner.release(group)


def _limits(config: EnvironmentConfig) -> Limits:
    """A long-lived sandbox's, with a thread per concurrent step."""
    limits = Limits.from_env().long_lived()
    return replace(limits, processes=max(limits.processes, config.threads + 64))


class EnvironmentHost(UserCode):
    """One sandbox holding a reference's environment instances for this worker process."""

    def __init__(self, ref: str, config: EnvironmentConfig) -> None:
        super().__init__(ref, f"environment '{ref}'", EnvironmentReferenceError, f"{HOST}:host_check",
                         limits=_limits(config))  # fmt: skip
        self.timeout_s, self.timed_out = config.env_step_timeout_s + GRACE_S, False

    def new(self) -> RemoteEnvironment:
        return RemoteEnvironment(self, self.run("host_new", [self.placed]))

    def run(self, function: str, args: list[Any]) -> Any:
        try:
            return self.call(f"{HOST}:{function}", args, self.timeout_s, kill_on_timeout=False)
        except SandboxTimeout:
            self.timed_out = True
            raise

    def release(self, envs: list[RemoteEnvironment]) -> None:
        if self.timed_out:  # threads of steps that never returned: end them with the process
            self.close("replaced after a batch with steps past their time limit")
            return
        try:
            self.run("host_drop", [[env.env_id for env in envs]])
        except SandboxError:
            pass  # the process is gone: nothing left to drop


class OpenEnvHost(UserCode):
    """A sandbox serving one OpenEnv app on a Unix socket this worker holds."""

    def __init__(self, ref: str, config: EnvironmentConfig) -> None:
        self.folder = Path(tempfile.mkdtemp(prefix="tandem-openenv-"))
        path = str(self.folder / "server.sock")
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            listener.bind(path)
            listener.listen(BACKLOG)
            fd = listener.fileno()  # the sandbox's copy is the one that serves
            super().__init__(ref, "its app", EnvironmentReferenceError, f"{HOST}:serve_app", [fd],
                             START_TIMEOUT_S, _limits(config), pass_fds=(fd,))  # fmt: skip
            self.server = OpenEnvServer(ref, "ws://localhost", config.env_step_timeout_s, socket_path=path)
        except EnvironmentReferenceError as err:
            self.close()
            raise EnvironmentReferenceError(
                f"environment '{ref}': its OpenEnv server did not start: {err}"
            ) from None
        finally:
            listener.close()

    def new(self) -> OpenEnvEnvironment:
        return self.server.new()

    def close(self, reason: str = "the OpenEnv server was stopped") -> None:
        if hasattr(self, "proc"):  # the sandbox started
            super().close(reason)
        shutil.rmtree(self.folder, ignore_errors=True)


class RemoteEnvironment:
    """An environment instance that lives in a sandbox; reset and step forward to it."""

    def __init__(self, host: EnvironmentHost, env_id: int) -> None:
        self.host, self.env_id = host, env_id

    def reset(self, row: dict[str, Any]) -> Any:
        return self.host.run("host_reset", [self.env_id, row])

    def step(self, assistant_text: str) -> Any:
        out = self.host.run("host_step", [self.env_id, assistant_text])
        if isinstance(out, dict) and isinstance(out.get("tuple"), list):
            return tuple(out["tuple"])
        return out.get("value") if isinstance(out, dict) else out  # not a tuple: StepResult says so


_classes: dict[str, type] = {}
_instances: dict[int, Any] = {}
_ids = itertools.count(1)


def host_check(ref: str) -> str:
    """What `ref` names: "class" (its instances live here) or "openenv" (a server app, served apart)."""
    _classes[ref] = load_environment_class(ref)
    return "openenv" if is_openenv_app(_classes[ref]) else "class"


def host_new(ref: str) -> int:
    if ref not in _classes:
        host_check(ref)
    env_id = next(_ids)
    _instances[env_id] = _classes[ref]()
    return env_id


def host_reset(env_id: int, row: dict[str, Any]) -> Any:
    return _instances[env_id].reset(row)


def host_step(env_id: int, assistant_text: str) -> Any:
    out = _instances[env_id].step(assistant_text)
    if isinstance(out, tuple) and len(out) == 4 and isinstance(out[3], dict):
        info = {k: v for k, v in out[3].items() if isinstance(v, bool | int | float | str | None)}
        out = (*out[:3], info)  # the rollout reads numbers and flags of info; the rest stays here
    return {"tuple": list(out)} if isinstance(out, tuple) else {"value": out}


def host_drop(ids: list[int]) -> None:
    for env_id in ids:
        _instances.pop(env_id, None)


def serve_app(ref: str, fd: int) -> bool:
    """Serve the OpenEnv app `ref` names on the listening socket `fd`, in a thread; True once it runs."""
    import sys

    import uvicorn

    sys.modules.setdefault("gradio", None)  # type: ignore[arg-type]  # OpenEnv's web UI: not served here
    app = load_environment_class(ref)
    if not is_openenv_app(app):
        raise EnvironmentReferenceError(f"environment '{ref}' is a class, not an OpenEnv server app")
    server = uvicorn.Server(uvicorn.Config(app, fd=fd, log_level="warning"))
    thread = threading.Thread(target=server.run, name="openenv-server", daemon=True)
    thread.start()
    deadline = time.monotonic() + START_TIMEOUT_S
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("uvicorn stopped before it served the app")
        time.sleep(0.05)
    return True
