"""Which of the repository's files one setting passes through: `optim.lr` from the REST request to
the optimizer, and a running job's live edit of it (docs/ARCHITECTURE.md §9).

A job is submitted over HTTP (`POST /v1/jobs`, the app on a TestClient) with a learning rate no
default has; the scheduler launches it (`Scheduler._launch`), with the job's controller actor run in
this process (`WorkloadActor`, the class Ray runs, called directly: `InProcessActor`); while it starts,
the rate is edited (`PATCH /v1/jobs/{id}/hyperparameters`, which the scheduler forwards to that
controller); the job trains one step on its Ray workers. The training worker is then built in this
process from the controller's typed config and given the edit, as the controller's group call does.
Every call is profiled in every thread (`sys.setprofile`); a file counts when a function defined in
it holds the setting in its arguments or locals: the value itself, or a dict, list, tuple, pydantic
model, dataclass or JSON text that holds it (the JobSpec, the job's row, `EngineConfig`, ...).

    .venv/bin/python -m tests.setting_path          (from the checkout's root)
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from pydantic import BaseModel

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("api", "service", "controller", "workers", "engines", "schema")
SUBMITTED_LR, EDITED_LR = 1.23456e-4, 6.54321e-5  # values no default or example has
MARKS = tuple(repr(v) for v in (SUBMITTED_LR, EDITED_LR))


def carries(obj: Any, depth: int = 0) -> bool:
    """Whether `obj` is the setting's value or holds it."""
    if isinstance(obj, float):
        return obj in (SUBMITTED_LR, EDITED_LR)
    if isinstance(obj, str | bytes):
        text = obj if isinstance(obj, str) else obj.decode("utf-8", "replace")
        return any(mark in text for mark in MARKS)
    if depth > 8:
        return False
    if isinstance(obj, dict):
        return any(carries(v, depth + 1) for v in obj.values())
    if isinstance(obj, list | tuple):
        return any(carries(v, depth + 1) for v in obj[:64])
    if isinstance(obj, BaseModel):
        return any(carries(v, depth + 1) for v in obj.__dict__.values())
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return any(carries(getattr(obj, f.name, None), depth + 1) for f in dataclasses.fields(obj))
    return False


# Where the setting goes on (`file suffix`, function): it is validated or wrapped into a model; it is
# stored in the job's row, which the scheduler reads; it is sent to another process (Ray, or the
# in-process stand-in below); the optimizer takes it.
ENDS = {
    ("pydantic/main.py", "BaseModel.__init__"),
    ("pydantic/main.py", "BaseModel.model_validate"),
    ("pydantic/main.py", "BaseModel.model_validate_json"),
    ("pydantic/main.py", "BaseModel.model_copy"),
    ("service/store.py", "JobStore.create_job"),
    ("service/store.py", "JobStore.update_job"),
    ("ray/actor.py", "ActorClass._remote"),
    ("ray/actor.py", "ActorMethod._remote"),
    ("tests/setting_path.py", "InProcessActor.__getattr__.<locals>.remote"),
    ("torch/optim/adamw.py", "AdamW.__init__"),
    ("engines/training/fsdp/engine.py", "FSDPEngine.set_learning_rate"),
}


def holds(frame: Any) -> bool:
    """Whether a frame holds the setting: in an argument or local, or an attribute of `self`."""
    local = frame.f_locals
    if any(carries(v) for v in local.values()):
        return True
    owner = getattr(local.get("self"), "__dict__", None)
    return owner is not None and any(carries(v) for v in owner.values())


@contextmanager
def recording() -> Iterator[dict[str, set[str]]]:
    """{file: {function, ...}}: the project's functions on the call stack (in any thread) when the
    setting reaches one of the ENDS, that hold it there."""
    seen: dict[str, set[str]] = {}
    prefix = str(ROOT) + os.sep

    def project_file(frame: Any) -> str | None:
        name = frame.f_code.co_filename
        rel = name[len(prefix) :] if name.startswith(prefix) else None
        return rel if rel is not None and rel.split(os.sep)[0] in PACKAGES else None

    def profile(frame, event, arg):  # noqa: ANN001 -- the sys.setprofile signature
        if event != "call":
            return
        code = frame.f_code
        if not any(code.co_qualname == q and code.co_filename.endswith(f) for f, q in ENDS):
            return
        if not holds(frame):
            return
        while frame is not None:
            rel = project_file(frame)
            if rel is not None and holds(frame):
                seen.setdefault(rel, set()).add(frame.f_code.co_qualname)
            frame = frame.f_back

    threading.setprofile(profile)
    sys.setprofile(profile)
    try:
        yield seen
    finally:
        sys.setprofile(None)
        threading.setprofile(None)


class InProcessActor:
    """A Ray actor handle's surface (`handle.method.remote(...)`) over an object in this process; `run`
    runs in a thread, as the actor runs it while the scheduler goes on."""

    def __init__(self, target: Any) -> None:
        self.target, self.threads = target, []

    def __getattr__(self, name: str) -> Any:
        method = getattr(self.target, name)

        def remote(*args: Any) -> Any:
            if name != "run":
                return method(*args)
            thread = threading.Thread(target=method, args=args, name="in-process-run")
            thread.start()
            self.threads.append(thread)
            return thread

        return type("Method", (), {"remote": staticmethod(remote)})()


class InProcessPool:
    """The scheduler's controller pool, handing out one in-process controller."""

    def __init__(self, runner: str) -> None:
        from service.workloads import WorkloadActor

        self.actor = InProcessActor(WorkloadActor(runner))

    def take(self) -> InProcessActor:
        return self.actor

    def fill(self) -> None: ...

    def close(self) -> None: ...


def setting_path(timeout_s: float = 900.0) -> dict[str, list[str]]:
    """{file: [functions]} along `optim.lr`'s path; needs a started local Ray (ray.init)."""
    from fastapi.testclient import TestClient

    from api.app import create_app
    from api.auth import ensure_admin_token
    from service.service import Service

    spec = {
        # a warmup: the rate the metrics report is a fraction of the setting, not its value
        "optim": {"lr": SUBMITTED_LR, "warmup_steps": 1},
        "trainer": {"total_steps": 1, "prompts_per_step": 2, "val_every": 0},
        "rollout": {"n": 2, "max_new_tokens": 2},
        "checkpoint": {"every": 100},
    }
    with tempfile.TemporaryDirectory() as tmp:
        service = Service(Path(tmp) / "home", warm_controllers=0)  # its scheduler is driven below
        service.scheduler.controllers = pool = InProcessPool(service.scheduler.workload.runner)
        token = ensure_admin_token(service.store, Path(tmp) / "home").read_text().strip()
        with TestClient(create_app(service), headers={"Authorization": f"Bearer {token}"}) as http:
            with recording() as seen:
                created = http.post("/v1/jobs", json=spec)
                created.raise_for_status()
                job = service.store.get_job(created.json()["id"])
                service.scheduler._launch(job, 0.0, 0.0)
                edited = http.patch(f"/v1/jobs/{job.id}/hyperparameters", json={"lr": EDITED_LR})
                edited.raise_for_status()
                for thread in pool.actor.threads:
                    thread.join(timeout_s)
                    if thread.is_alive():
                        raise TimeoutError(f"job {job.id} did not finish within {timeout_s:g} s")
                worker_side(pool.actor.target.runner.trainer.spec)
        service.scheduler.running.clear()  # run here, ended: no actor to stop
        service.shutdown(timeout_s=60)
    return {file: sorted(functions) for file, functions in sorted(seen.items())}


def worker_side(spec: Any) -> None:
    """The training worker as its Ray process runs it: built from the controller's config, then the
    live edit's group call."""
    from controller.job_setup import hybrid_config
    from controller.models import resolve_model_path
    from workers.actor_role import ActorRolloutRefWorker

    config = hybrid_config(spec, resolve_model_path(spec.model))
    os.environ.update({"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29534"})
    worker = ActorRolloutRefWorker(config)
    worker.set_hyperparameters(lr=EDITED_LR)


def main() -> None:
    import ray

    ray.init(num_cpus=4, include_dashboard=False, runtime_env={"env_vars": {"PYTHONPATH": str(ROOT)}})
    with tempfile.TemporaryDirectory() as home:
        os.environ.setdefault("TANDEM_HOME", home)
        path = setting_path()
    print(json.dumps(path, indent=1))
    print(json.dumps({"optim.lr_files": len(path)}))


if __name__ == "__main__":
    main()
