"""The job's single controller as a threaded Ray actor: `run()` holds one thread for the whole job while
`drain()` (records polled by the service), `request_stop()` and `set_hyperparameters()` answer on
others. A crash inside the job comes back as a "failed" result with its traceback.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

from controller.metric_format import format_metrics
from controller.recovery import worker_pids
from controller.trackers import TrackerSink, with_trackers
from controller.trainer import StopRequested, Trainer
from controller.worker_output import ENV as WORKER_OUTPUT_ENV
from controller.worker_output import FILENAME as WORKER_OUTPUT_FILE
from controller.worker_output import OutputTail
from schema.job import JobSpec

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
QUEUES = ("events", "metrics", "checkpoints", "samples")  # what a drain hands the service


class BufferSink:
    """A JobSink that keeps records until the service drains them. `flush` waits until the service
    says (`committed`) it stored every record so far: a checkpoint is committed only after its steps'
    records, so a service killed at any moment never resumes from a checkpoint it has no record of."""

    FLUSH_TIMEOUT_S = 120.0

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._stored = threading.Condition(self._lock)
        self._queues: dict[str, deque] = {name: deque() for name in QUEUES}
        self._rewind: int | None = None  # a restart went back to this step: the store forgets later metrics
        self._appended = 0  # records appended so far (events, metrics, samples)
        self._committed = 0  # of those, how many the service has stored
        self.step = 0
        self.total = 0

    def _append(self, queue: str, record: tuple, checkpoint: tuple | None = None) -> None:
        with self._lock:  # a checkpoint's record is drained with its event
            self._queues[queue].append(record)
            self._appended += 1
            if checkpoint is not None:
                self._queues["checkpoints"].append(checkpoint)

    def event(self, kind: str, message: str, **data: Any) -> None:
        checkpoint = (data["step"], data["path"]) if kind == "checkpoint" else None
        self._append("events", (time.time(), kind, message, data), checkpoint)
        logging.getLogger("tandem.job").info("[%s] %s", kind, message)

    def metrics(self, step: int, values: dict[str, float]) -> None:
        self._append("metrics", (time.time(), step, values))

    def samples(self, step: int, rows: list[dict[str, Any]]) -> None:
        self._append("samples", (time.time(), step, rows))

    def rewind(self, step: int) -> None:
        """Metrics after `step` are dropped here, and the next drain tells the service to forget its own."""
        with self._lock:
            self._queues["metrics"] = deque(m for m in self._queues["metrics"] if m[1] <= step)
            self._rewind = step if self._rewind is None else min(self._rewind, step)

    def flush(self) -> None:
        """Wait until the service stored every record so far (past FLUSH_TIMEOUT_S: warn and go on)."""
        with self._lock:
            target = self._appended
            if not self._stored.wait_for(lambda: self._committed >= target, self.FLUSH_TIMEOUT_S):
                logging.getLogger("tandem.job").warning(
                    "the service stored %d of %d records within %.0f s; committing the checkpoint anyway",
                    self._committed,
                    target,
                    self.FLUSH_TIMEOUT_S,
                )

    def committed(self, seq: int) -> None:
        with self._lock:
            self._committed = max(self._committed, seq)
            self._stored.notify_all()

    def progress(self, step: int, total: int, values: dict[str, float]) -> None:
        self.step, self.total = step, total
        shown = format_metrics(values)
        logging.getLogger("tandem.job").info("step %d/%d %s", step, total, shown)

    def drain(self) -> dict[str, list]:
        with self._lock:
            out: dict[str, Any] = {name: list(q) for name, q in self._queues.items()}
            out.update(rewind=self._rewind, seq=self._appended)
            self._rewind = None
            for q in self._queues.values():
                q.clear()
        return out


class _LogBuffer(logging.Handler):
    """The job's log lines until drained; after a restart each line starts with its attempt."""

    def __init__(self, attempt: Callable[[], int] = lambda: 1) -> None:
        super().__init__(level=logging.INFO)
        self.attempt = attempt
        self.setFormatter(logging.Formatter(LOG_FORMAT))
        self._lock_lines = threading.Lock()
        self.lines: deque = deque(maxlen=100_000)

    def emit(self, record: logging.LogRecord) -> None:
        with self._lock_lines:
            self.lines.append((record.created, record.levelname, mark(self.format(record), self.attempt())))

    def drain(self) -> list[tuple[float, str, str]]:
        with self._lock_lines:
            out = list(self.lines)
            self.lines.clear()
        return out


def mark(line: str, attempt: int) -> str:
    return f"[attempt {attempt}] {line}" if attempt > 1 else line


class JobController:
    """Ray actor body (created with max_concurrency > 1 by the service)."""

    def __init__(self, job_id: str, spec: JobSpec | dict[str, Any], workdir: str, restarts: int = 0) -> None:
        self.job_id, self.workdir = job_id, Path(workdir)
        spec = spec if isinstance(spec, JobSpec) else JobSpec.model_validate(spec)  # the trainer keeps it
        self.sink = BufferSink()
        self.logs = _LogBuffer(attempt=lambda: self.trainer.recovery.attempt)
        root = logging.getLogger()
        root.addHandler(self.logs)
        root.setLevel(logging.INFO)
        # This actor's process is the job's alone: its workers inherit where to write their output.
        self.workdir.mkdir(parents=True, exist_ok=True)
        os.environ[WORKER_OUTPUT_ENV] = str(self.workdir / WORKER_OUTPUT_FILE)
        self.worker_output = OutputTail(self.workdir / WORKER_OUTPUT_FILE)
        self.trackers = with_trackers(self.sink, spec, self.workdir, job_id)
        self.trainer = Trainer(spec, self.workdir, self.trackers, name=job_id, restarts=restarts)

    def run(self) -> dict[str, Any]:
        log = logging.getLogger("tandem.job")
        try:
            self.trainer.run()
            return {"status": "succeeded", "step": self.trainer.step_index}
        except StopRequested as stop:
            status = "paused" if str(stop) == "pause" else "cancelled"
            log.info("job %s %s at step %d", self.job_id, status, self.trainer.step_index)
            return {"status": status, "step": self.trainer.step_index}
        except Exception as err:  # the job fails; the service stays up and records why
            log.error("job %s failed:\n%s", self.job_id, traceback.format_exc())
            return {
                "status": "failed",
                "step": self.trainer.step_index,
                "error": f"{type(err).__name__}: {err}",
            }
        finally:
            if isinstance(self.trackers, TrackerSink):
                self.trackers.close()  # each tracker's run ends here; a resumed job continues it

    def drain(self) -> dict[str, Any]:
        out = self.sink.drain()
        attempt = self.trainer.recovery.attempt
        worker_lines = [(at, level, mark(line, attempt)) for at, level, line in self.worker_output.read()]
        out["logs"] = self.logs.drain() + worker_lines
        out["step"] = self.trainer.completed_steps
        out["restart"] = self.trainer.recovery.status  # None unless a restart is under way
        return out

    def pid(self) -> int:
        return os.getpid()

    def worker_pids(self) -> dict[str, list[int]]:
        """The process id of every rank of the job's worker groups ({} before they start)."""
        job = self.trainer.job
        return worker_pids(job.groups) if job is not None else {}

    def committed(self, seq: int) -> None:
        self.sink.committed(seq)

    def request_stop(self, reason: str) -> None:
        self.trainer.control.request_stop(reason)

    def set_hyperparameters(self, changes: dict[str, Any]) -> None:
        self.trainer.control.set_hyperparameters(changes)

    def checkpoint_now(self) -> None:
        self.trainer.control.checkpoint_now = True
