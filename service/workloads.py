"""Workloads: what the scheduler launches, accounts for and steers, without knowing what they run.

A kind says, without torch, what a record needs (`needs`) and which API requests steer it (`actions`).
An RL/SFT job's runner class is imported only inside the record's own Ray actor (`WorkloadActor`), so
the API process never loads torch; a Tinker training run is a *hosted* kind, served many at once by a
process per base model (service/tinker_hosts.py). A runner is built as
`Runner(record_id, spec_dict, workdir, **options)` and answers the `Runner` protocol.
"""

from __future__ import annotations

import importlib
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from controller import checkpoints
from controller.resource_pool import job_needs
from service.job_state import JobStatus
from service.tinker_checkpoints import lost_message


@dataclass(frozen=True)
class Needs:
    """What one record holds while it runs: its CPUs and GPUs, and the bundles it asks Ray for."""

    cpus: float
    gpus: float
    bundles: list[dict[str, float]] = field(default_factory=list)


class Runner(Protocol):
    def run(self) -> dict[str, Any]:
        """Runs to the end; returns {"status": succeeded|paused|cancelled|failed, "step", "error"?}."""
        ...

    def drain(self) -> dict[str, Any]: ...

    def committed(self, seq: int) -> None: ...

    def request_stop(self, reason: str) -> None: ...

    def set_hyperparameters(self, changes: dict[str, Any]) -> None: ...

    def checkpoint_now(self) -> None: ...

    def worker_pids(self) -> dict[str, list[int]]:
        """The processes of the record's workers by group, in rank order."""
        ...


BEGIN_WAIT_S = 600.0  # a call that needs the runner waits this long for `begin` to build it


class WorkloadActor:
    """Every record's Ray actor: imports its runner's module at start (so it can wait warm,
    service/controller_pool.py), builds the runner for one record in `begin`, and forwards calls to it.
    The actor is threaded: a call sent after `begin` may start before it ends, so calls wait for it."""

    def __init__(self, runner: str) -> None:
        module, _, name = runner.partition(":")
        self._runner_cls = getattr(importlib.import_module(module), name)
        self._runner: Runner | None = None
        self._failed: str | None = None
        self._begun = threading.Event()
        self._begin_lock = threading.Lock()

    def begin(
        self, record_id: str, spec: dict[str, Any], workdir: str, options: dict[str, Any] | None = None
    ) -> None:
        with self._begin_lock:
            if self._begun.is_set():
                raise RuntimeError("this controller already serves a record; a controller serves one")
            try:
                self._runner = self._runner_cls(record_id, spec, workdir, **(options or {}))
            except Exception as err:
                self._failed = f"{type(err).__name__}: {err}"
                raise
            finally:
                self._begun.set()

    @property
    def runner(self) -> Runner:
        """The record's runner, once `begin` built it (waits for it, at most BEGIN_WAIT_S)."""
        if not self._begun.wait(BEGIN_WAIT_S):
            raise TimeoutError(f"the record's runner was not built within {BEGIN_WAIT_S:g} s")
        if self._runner is None:
            raise RuntimeError(f"the record's runner failed to build: {self._failed}")
        return self._runner

    def pid(self) -> int:
        """This actor's process (a test kills it to lose the record's controller)."""
        return os.getpid()

    def worker_pids(self) -> dict[str, list[int]]:
        """The runner's worker processes by role ({} for a runner without any, or before they start)."""
        if self._runner is None:
            return {}
        pids = getattr(self._runner, "worker_pids", None)
        return pids() if pids is not None else {}


def _forward(name: str) -> Callable[..., Any]:
    def call(self: WorkloadActor, *args: Any) -> Any:
        return getattr(self.runner, name)(*args)

    call.__name__ = call.__qualname__ = name
    return call


# The Runner calls the actor takes (Ray sees them as the actor's methods), each passed to the runner.
for _name in ("run", "drain", "committed", "request_stop", "set_hyperparameters", "checkpoint_now"):
    setattr(WorkloadActor, _name, _forward(_name))


class RLJobWorkload:
    """An RL or SFT job (controller/): a JobSpec run by `controller.job_actor.JobController`."""

    refusal = "an RL job"
    runner = "controller.job_actor:JobController"  # imported in the record's actor process only
    actions = frozenset(  # the requests that steer its records
        {"pause", "resume", "fork", "hyperparameters", "checkpoint", "labels", "cancel", "delete"}
    )

    def needs(self, spec: dict[str, Any]) -> Needs:
        return Needs(*job_needs(spec))

    def committed_checkpoints(self, workdir: str | Path) -> list[tuple[int, Path]]:
        """(step, folder) of the complete checkpoints on disk, oldest first."""
        return checkpoints.complete(Path(workdir))

    def resume_step(self, workdir: str | Path) -> int:
        """The step a record starts from: its latest committed checkpoint, 0 without one."""
        saved = self.committed_checkpoints(workdir)
        return saved[-1][0] if saved else 0


RL_JOB = RLJobWorkload()


class RunServer(Protocol):
    """What serves a hosted kind's records (the Tinker API's TinkerService)."""

    def launch(self, record: Any) -> None: ...

    def stop(self, record_id: str) -> None: ...

    def expire_sessions(self) -> None: ...

    def shutdown(self) -> None: ...


class TinkerRunWorkload:
    """A Tinker API training run: a LoRA adapter on its base model's shared session host, whose CPUs are
    held once per base (`Scheduler.hold`). Its client drives it: Tandem's API only labels, cancels and
    deletes it."""

    actions = frozenset({"labels", "cancel", "delete"})
    refusal = "a Tinker training run: its client drives it through the Tinker API"

    def __init__(self) -> None:
        self.server: RunServer | None = None  # set when the Tinker API starts (api/app.py)

    def needs(self, spec: dict[str, Any]) -> Needs:
        return Needs(0.0, 0.0)

    def launch(self, record: Any) -> None:
        if self.server is None:
            raise RuntimeError("this service serves no Tinker API")
        self.server.launch(record)

    def stop(self, record_id: str) -> None:
        if self.server is not None:
            self.server.stop(record_id)

    def tend(self) -> None:
        """On every scheduler pass: silent clients' sessions end even when no other client calls."""
        if self.server is not None:
            self.server.expire_sessions()

    def recover(self, record: Any) -> tuple[JobStatus, str]:
        """At a service start: a running run's host went with the old service (paused, naming its last
        saved state); a queued one's client request went too."""
        if record.status == JobStatus.QUEUED:
            return (
                JobStatus.CANCELLED,
                "the service restarted before the run started: create a new training client",
            )
        return JobStatus.PAUSED, lost_message(record.id, Path(record.workdir))
