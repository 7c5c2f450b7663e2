"""`tandem serve`: the long-lived Ray driver that serves the API.

It starts a local Ray cluster, or joins one (`--ray-address auto | ray://host:10001`, or RAY_ADDRESS),
opens the job store under TANDEM_HOME, makes sure an admin token exists, and serves the API with
uvicorn. On SIGTERM or Ctrl-C uvicorn stops taking requests, then every running job is paused
(each saves a checkpoint at its next step boundary) and is resumed by the next start.
"""

from __future__ import annotations

import logging
import os
import signal
from pathlib import Path

import ray
import uvicorn

from api.app import create_app
from api.auth import ensure_admin_token
from api.reaper import watch
from api.settings import ServeSettings
from controller.models import tandem_home
from controller.service import Service

log = logging.getLogger("tandem.server")


def init_ray(address: str | None, num_cpus: int | None = None, home: Path | None = None) -> None:
    if ray.is_initialized():
        return
    env_vars = {"TOKENIZERS_PARALLELISM": "false"}
    if home is not None:  # job actors run in the raylets' environment, not this one: tell them --home
        env_vars["TANDEM_HOME"] = str(home)
    env = {"env_vars": env_vars}
    address = address or os.environ.get("RAY_ADDRESS") or None
    if address:
        ray.init(address=address, namespace="tandem", runtime_env=env, logging_level="warning")
    else:
        ray.init(num_cpus=num_cpus, namespace="tandem", runtime_env=env, include_dashboard=False,
                 logging_level="warning")  # fmt: skip


def serve(
    host: str = "127.0.0.1",
    port: int = 8000,
    home: str | Path | None = None,
    ray_address: str | None = None,
    num_cpus: int | None = None,
    shutdown_timeout_s: float = 300.0,
    settings: ServeSettings | None = None,
) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    home = Path(home).expanduser().resolve() if home else tandem_home()
    reaper = watch()  # kills what Ray leaves behind once this process is gone, even after SIGKILL
    init_ray(ray_address, num_cpus, home)
    service = Service(home)
    service.start()
    token_file = ensure_admin_token(service.store, home)
    app = create_app(service, settings)
    url = f"http://{host}:{port}"
    print(f"Tandem is serving on {url}  (dashboard {url}/, API docs {url}/docs)", flush=True)
    print(f"Admin token: {token_file} (or TANDEM_ADMIN_TOKEN); job store: {service.store.path}", flush=True)
    server = uvicorn.Server(
        uvicorn.Config(app, host=host, port=port, log_level="warning", timeout_graceful_shutdown=5)
    )
    try:
        server.run()
    except SystemExit as stop:
        # uvicorn stops gracefully on SIGTERM, then re-raises the signal to the handler it found: the Ray
        # driver's, which exits with code 15. A requested stop is not a failure: exit 0 once jobs paused.
        if stop.code != signal.SIGTERM:
            raise
    finally:
        log.info("stopping: pausing running jobs so they resume from a checkpoint")
        service.shutdown(timeout_s=shutdown_timeout_s)
        ray.shutdown()
        reaper.stdin.close()  # done: the watcher cleans up now
