"""What every experiment tracker offers the job: one small interface, and the run's identity on disk.

A tracker (TensorBoard, Weights & Biases, MLflow) is opened once per job start with the job's
`RunInfo`, then receives every step's metrics, hyper-parameter changes and stored samples, and is
closed when the job's run ends (finished, paused, cancelled or failed). Its run id is kept in the
job's folder (`trackers.json`), so a resumed job continues the same run; a fork finds its parent's
ids in the checkpoint it starts from (`trackers.json` beside the checkpoint's files) and links to
them.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

log = logging.getLogger("tandem.trackers")

RUN_IDS_FILE = "trackers.json"


@dataclass
class RunInfo:
    """Who the run is: the job, where its files go, its spec, and the run ids already known."""

    job_id: str
    workdir: Path
    project: str
    config: dict[str, Any]  # the JobSpec as JSON
    mlflow_uri: str | None = None
    run_ids: dict[str, str] = field(default_factory=dict)  # this job's own, from an earlier start
    parent_ids: dict[str, str] = field(default_factory=dict)  # a fork's parent's
    parent_job: str | None = None


class Tracker(Protocol):
    name: str

    def open(self, info: RunInfo) -> str:
        """Start or continue the run; returns its id (kept for the next start)."""
        ...

    def metrics(self, step: int, values: dict[str, float]) -> None: ...

    def hyperparameters(self, step: int, changes: dict[str, Any]) -> None: ...

    def samples(self, step: int, rows: list[dict[str, Any]]) -> None: ...

    def close(self) -> None: ...


def read_run_ids(folder: Path | None) -> dict[str, Any]:
    """The ids in `folder/trackers.json` ({} when there is none or it cannot be read)."""
    if folder is None:
        return {}
    try:
        return json.loads((Path(folder) / RUN_IDS_FILE).read_text())
    except (OSError, ValueError):
        return {}


def write_run_ids(folder: Path, ids: dict[str, Any]) -> None:
    """Write atomically: a checkpoint copied by a fork never holds half a file."""
    target = Path(folder) / RUN_IDS_FILE
    partial = target.with_suffix(".json.partial")
    partial.write_text(json.dumps(ids, indent=1))
    partial.replace(target)


def flatten(config: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"optim": {"lr": 1e-3}} -> {"optim.lr": 1e-3}: what trackers without nesting take."""
    out: dict[str, Any] = {}
    for key, value in config.items():
        if isinstance(value, dict) and value:
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def sample_table(step: int, rows: list[dict[str, Any]]) -> tuple[list[str], list[list[Any]]]:
    """A step's stored samples as table columns and rows: the conversation as one text cell."""
    columns = ["step", "index", "prompt", "conversation", "reward", "finish_reason"]
    data = []
    for row in rows:
        talk = "\n".join(f"{turn['role']}: {turn['content']}" for turn in row.get("turns", []))
        data.append([step, row.get("index"), str(row.get("prompt", "")), talk, row.get("reward"),
                     row.get("finish_reason")])  # fmt: skip
    return columns, data
