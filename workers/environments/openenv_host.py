"""An OpenEnv server app named by a user's reference, started by the job in a sandbox of its own.

The sandbox has no network (workers/sandbox/), so the server cannot listen on a port: the worker
binds a Unix socket in a folder of its own (mode 0700, invisible in the sandbox) and hands the
sandbox only the listening descriptor, on which uvicorn serves the app. The worker's client
(openenv_client.py) connects to that socket; the sandbox can neither reach the network nor change
where the worker connects. The server lives as long as the sandbox: one per reference in each
rollout worker process, replaced by `environment_factory` (sandboxed.py) when its process died.

`serve_app` is the sandbox's side.
"""

from __future__ import annotations

import shutil
import socket
import tempfile
import threading
import time
from dataclasses import replace
from pathlib import Path

from schema.workers import EnvironmentConfig
from workers.environments.loader import EnvironmentReferenceError, load_environment_class
from workers.environments.openenv_client import OpenEnvEnvironment, OpenEnvServer
from workers.environments.openenv_ref import is_openenv_app
from workers.references import is_path_reference
from workers.sandbox.channel import Sandbox, SandboxError
from workers.sandbox.limits import Limits

START_TIMEOUT_S = 120.0  # importing the app (OpenEnv, FastAPI, the user's packages) and starting it
BACKLOG = 256


class OpenEnvHost:
    """A sandbox serving one OpenEnv app on a socket this worker holds; see the module docstring."""

    def __init__(self, ref: str, config: EnvironmentConfig) -> None:
        self.folder = Path(tempfile.mkdtemp(prefix="tandem-openenv-"))
        path = str(self.folder / "server.sock")
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(path)
        listener.listen(BACKLOG)
        fd = listener.fileno()
        limits = Limits.from_env().long_lived()
        limits = replace(limits, processes=max(limits.processes, config.threads + 64))
        files = [ref.rpartition(":")[0]] if is_path_reference(ref) else []
        try:
            self.box = Sandbox(files, limits, stderr=None, pass_fds=(fd,))
        finally:
            listener.close()  # the sandbox's copy is the one that serves
        try:
            self.box.call(f"{__name__}:serve_app", [self.box.place(ref), fd], START_TIMEOUT_S)
            self.server = OpenEnvServer(ref, "ws://localhost", config.env_step_timeout_s, socket_path=path)
        except (SandboxError, EnvironmentReferenceError) as err:
            self.close()
            message = err.message if isinstance(err, SandboxError) and err.type else str(err)
            raise EnvironmentReferenceError(
                f"environment '{ref}': its OpenEnv server did not start: {message}"
            ) from None

    def new(self) -> OpenEnvEnvironment:
        return self.server.new()

    def close(self) -> None:
        self.box.close("the OpenEnv server was stopped")
        shutil.rmtree(self.folder, ignore_errors=True)


# ---- the sandbox's side -----------------------------------------------------------------------


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
