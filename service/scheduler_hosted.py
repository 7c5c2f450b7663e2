"""The scheduler's hosted records (Tinker training runs): queued, scheduled and counted as jobs are, but
a launch hands one to the process that serves it, and it holds its slot until that server ends it.
The hosts hold CPUs while they run (`hold`), and RL jobs are scheduled around them.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from service.job_state import RUN_HOLDING, TERMINAL, JobStatus, allowed
from service.scheduler_runs import RunningJob
from service.store import JobRecord, JobStore
from service.workloads import TinkerRunWorkload

S = JobStatus


class HostedRecords:
    """Mixed into the Scheduler, whose store, running records and lock these share."""

    store: JobStore
    running: dict[str, RunningJob]
    _lock: threading.RLock

    def __init__(self) -> None:
        self.hosted: dict[str, Any] = {"tinker": TinkerRunWorkload()}  # kinds with a table of their own
        self.held: dict[str, float] = {}  # CPUs of the processes serving them

    def hold(self, key: str, cpus: float) -> None:
        """Count a process that serves hosted records (a session host) as holding these CPUs."""
        with self._lock:
            self.held[key] = cpus

    def release(self, key: str) -> None:
        with self._lock:
            self.held.pop(key, None)

    def recover_hosted(self, record: JobRecord) -> None:
        """At a service start: its server went with the old service."""
        self.end(record.id, *self.hosted[record.method].recover(record))

    def stop_hosted(self, record: JobRecord) -> None:
        """Its server drops it at once."""
        self.hosted[record.method].stop(record.id)
        self.end(
            record.id, S.CANCELLED, "cancelled through Tandem's API (tandem cancel); its checkpoints stay"
        )

    def shutdown_hosted(self) -> None:
        """The servers stop; their records stay `running` until the next start recovers them."""
        for kind in self.hosted.values():
            if kind.server is not None:
                kind.server.shutdown()
        with self._lock:
            for record_id in [i for i, run in self.running.items() if run.actor is None]:
                del self.running[record_id]

    def launch_hosted(self, record: JobRecord, cpus: float, gpus: float) -> None:
        self.running[record.id] = RunningJob(None, None, cpus, gpus, -1, record.owner)
        try:
            self.hosted[record.method].launch(record)
        except Exception as err:  # noqa: BLE001 - the record fails, naming why; the loop goes on
            self.end(record.id, S.FAILED, f"could not start: {type(err).__name__}: {err}")
            return
        self.store.add_event(record.id, "started", "served by its base model's session host")

    def end(self, record_id: str, status: JobStatus, why: str | None = None) -> bool:
        """A hosted record's run ended (its server says why): its status and an event, its slot free.
        True when its status changed."""
        sources = tuple(s for s in (S.QUEUED, *RUN_HOLDING) if allowed(s, status))
        done = {"finished_at": time.time()} if status in TERMINAL else {}
        moved = self.store.transition(record_id, sources, status, error=why, **done)
        if moved:
            self.store.add_event(record_id, status, why or str(status))
        with self._lock:
            self.running.pop(record_id, None)
        return moved

    def forget(self, record_id: str) -> None:
        """A hosted record its server refused to start leaves no trace: its slot and its rows go."""
        with self._lock:
            self.running.pop(record_id, None)
        if self.store.get_job(record_id) is not None:
            self.store.delete_job(record_id)
