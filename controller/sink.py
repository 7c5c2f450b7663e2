"""Where a job's record goes: events, per-step metrics, samples and progress. The trainer only talks
to a `JobSink`; `JsonlSink` appends JSON lines in the job's folder (what `make run` shows), the
service plugs in a sink that writes to its job store.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any, Protocol

from controller.metric_format import format_metrics

log = logging.getLogger("tandem.job")


class JobSink(Protocol):
    def event(self, kind: str, message: str, **data: Any) -> None: ...

    def metrics(self, step: int, values: dict[str, float]) -> None: ...

    def progress(self, step: int, total: int, values: dict[str, float]) -> None: ...

    def samples(self, step: int, rows: list[dict[str, Any]]) -> None: ...

    def flush(self) -> None:
        """Return once every record so far outlives this process (a checkpoint is committed after it)."""
        ...

    def rewind(self, step: int) -> None:
        """A restart went back to `step`: later steps' metric rows will be recomputed and replaced."""
        ...


class JsonlSink:
    """Appends records as JSON lines under `folder`; keeps events and metrics in memory too."""

    def __init__(self, folder: str | Path, echo: bool = False) -> None:
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.echo = echo
        self.events: list[dict[str, Any]] = []
        self.history: list[dict[str, Any]] = []

    def _append(self, name: str, record: dict[str, Any]) -> None:
        with (self.folder / name).open("a") as f:
            f.write(json.dumps(record, default=str) + "\n")

    def event(self, kind: str, message: str, **data: Any) -> None:
        record = {"time": time.time(), "kind": kind, "message": message, "data": data}
        self.events.append(record)
        self._append("events.jsonl", record)
        log.info("%s: %s", kind, message)
        if self.echo:
            print(f"[{kind}] {message}", flush=True)

    def metrics(self, step: int, values: dict[str, float]) -> None:
        record = {"time": time.time(), "step": step, "values": values}
        self.history.append(record)
        self._append("metrics.jsonl", record)

    def samples(self, step: int, rows: list[dict[str, Any]]) -> None:
        self._append("samples.jsonl", {"time": time.time(), "step": step, "samples": rows})

    def flush(self) -> None:
        """Each record is written (and its file closed) when it is made."""

    def rewind(self, step: int) -> None:
        """metrics.jsonl keeps every line (a later one of a step wins); the history keeps one per step."""
        self.history = [r for r in self.history if r["step"] <= step]

    def progress(self, step: int, total: int, values: dict[str, float]) -> None:
        if self.echo:
            shown = format_metrics(values)
            print(f"step {step}/{total} {shown}", flush=True)
