"""`tandem serve`: the long-lived Ray driver that serves the API.

It starts or joins a Ray cluster, opens the job store under TANDEM_HOME, makes sure an admin token
exists, and serves the API with uvicorn, recording its URL in $TANDEM_HOME/service.json. On SIGTERM or
Ctrl-C every running job is paused at a checkpoint, and the next start resumes it.
"""

from __future__ import annotations

import gc
import logging
import os
import signal
from pathlib import Path
from typing import Any

import ray
import uvicorn

from api.app import create_app
from api.auth import ensure_admin_token
from api.reaper import watch
from api.service_record import choose_port, read_record, remove_record, write_record
from api.settings import ServeSettings
from controller.models import tandem_home
from service.service import Service
from workers.sandbox.launch import SandboxUnavailable, sandbox_mode
from workers.sandbox.limits import ENV_UNSANDBOXED

log = logging.getLogger("tandem.server")
DEFAULT_PORT = 8000
SHUTDOWN_TIMEOUT_S = 300.0  # running jobs get this long to pause at a checkpoint
RAY_START_TRIES = 3  # a local Ray gives its node 30 s to start, which a loaded 2-core machine can miss


def init_ray(
    address: str | None,
    num_cpus: int | None = None,
    home: Path | None = None,
    env: dict[str, str] | None = None,
) -> None:
    if ray.is_initialized():
        return
    env_vars = {"TOKENIZERS_PARALLELISM": "false", **(env or {})}
    if home is not None:  # job actors run in the raylets' environment, not this one: tell them --home
        env_vars["TANDEM_HOME"] = str(home)
    # Workers' output belongs in the job's log (controller/worker_output.py), not this terminal.
    common = {"namespace": "tandem", "runtime_env": {"env_vars": env_vars}, "logging_level": "warning",
              "log_to_driver": False}  # fmt: skip
    address = address or os.environ.get("RAY_ADDRESS") or None
    if address:
        ray_init(address=address, **common)
    else:
        logging.getLogger(RAY_TOKEN_SETUP_LOGGER).addFilter(drop_token_auth_notice)
        ray_init(num_cpus=num_cpus, include_dashboard=False, **common)


# A new local Ray cluster turns its token authentication on and warns about it at every start: Tandem
# keeps it on and drops that one notice (docs/troubleshooting.md). RAY_AUTH_MODE=token would not do:
# Ray reads its config at import, before serve could set it.
RAY_TOKEN_SETUP_LOGGER = "ray._private.authentication.authentication_token_setup"


def drop_token_auth_notice(record: logging.LogRecord) -> bool:
    return "Token authentication is enabled for this Ray cluster" not in record.getMessage()


def ray_init(**kwargs: Any) -> None:
    """`ray.init`, tried again when a local node misses Ray's fixed 30 s start window (a busy machine)."""
    for attempt in range(1, RAY_START_TRIES + 1):
        try:
            ray.init(**kwargs)
            return
        except Exception as err:  # Ray raises a bare Exception when its node is slow to come up
            if "timed out during startup" not in str(err) or attempt == RAY_START_TRIES:
                raise
            log.warning("Ray's node did not start within Ray's 30 s (a busy machine?): trying again (%d/%d)",
                        attempt + 1, RAY_START_TRIES)  # fmt: skip
            ray.shutdown()


def serve(
    host: str = "127.0.0.1",
    port: int | None = None,
    home: str | Path | None = None,
    ray_address: str | None = None,
    num_cpus: int | None = None,
    settings: ServeSettings | None = None,
) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    home = Path(home).expanduser().resolve() if home else tandem_home()
    running = read_record(home)
    if running:
        raise SystemExit(
            f"tandem serve: a service already runs on {home} at {running['url']} (pid {running['pid']}); "
            "stop it first, or give another --home"
        )
    if port is None:
        preferred = int(os.environ.get("TANDEM_PORT") or DEFAULT_PORT)
        port = choose_port(host, preferred)
        if port != preferred:
            print(f"port {preferred} is taken: serving on {port} instead", flush=True)
    settings = settings or ServeSettings()
    try:
        quotas = settings.quota_book()
    except (OSError, ValueError) as err:  # a missing or invalid quotas file: say so before starting anything
        raise SystemExit(f"tandem serve: quotas file {settings.quotas_file}: {err}") from None
    reaper = watch()  # kills what Ray leaves behind once this process is gone, even after SIGKILL
    init_ray(ray_address, num_cpus, home, user_code_env(settings))
    service = Service(home, quotas=quotas, warm_controllers=settings.warm_controllers)
    service.start()
    token_file = ensure_admin_token(service.store, home)
    app = create_app(service, settings)
    url = f"http://{_client_host(host)}:{port}"
    print(f"Tandem is serving on {url}  (dashboard {url}/, API docs {url}/docs)", flush=True)
    print(f"Admin token: {token_file} (or TANDEM_ADMIN_TOKEN); job store: {service.store.path}", flush=True)
    print(f"User code: {describe_sandbox(settings)}", flush=True)
    # access_log off: at level warning uvicorn prints no access line, but would still build one per request
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False,
                                           timeout_graceful_shutdown=5))  # fmt: skip
    write_record(home, url)
    freeze_heap()
    try:
        server.run()
    except SystemExit as stop:
        # uvicorn re-raises SIGTERM to the Ray driver's handler, which exits 15: a requested stop is
        # not a failure, so exit 0 once the jobs paused.
        if stop.code != signal.SIGTERM:
            raise
    finally:
        # A second signal (Ctrl-C reaches `make run` too, which then sends SIGTERM) must not cut the
        # stop short: jobs would not pause and the record would stay.
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, _already_stopping)
        log.info("stopping: pausing running jobs so they resume from a checkpoint")
        service.shutdown(timeout_s=SHUTDOWN_TIMEOUT_S)
        ray.shutdown()
        # Frozen objects are never freed: nanobind would report them as leaked at exit.
        gc.unfreeze()
        reaper.stdin.close()  # done: the watcher cleans up now
        remove_record(home)


def user_code_env(settings: ServeSettings) -> dict[str, str]:
    """The operator's user-code settings as environment, for job processes and this one's checks."""
    env = settings.user_code_limits().to_env()
    if settings.unsandboxed_user_code:
        env[ENV_UNSANDBOXED] = "1"
    os.environ.update(env)
    return env


def describe_sandbox(settings: ServeSettings) -> str:
    """The start-up line about user code: sandboxed, unsandboxed by the operator's flag, or refused."""
    try:
        return sandbox_mode(settings.unsandboxed_user_code).note
    except SandboxUnavailable as err:
        return f"REFUSED (reward functions, environments and agents other than built-ins): {err}"


def _already_stopping(signum: int, _frame: object) -> None:
    log.info("%s: already stopping (pausing running jobs first)", signal.Signals(signum).name)


def freeze_heap() -> None:
    """Keep the garbage collector off what start-up made (hundreds of thousands of objects from the
    imports): every full collection would walk them all, stopping every request in flight."""
    gc.collect()
    gc.freeze()


def _client_host(host: str) -> str:
    """The host a local client dials: a wildcard bind address is reached on the loopback."""
    return {"0.0.0.0": "127.0.0.1", "::": "[::1]", "": "127.0.0.1"}.get(host, host)
