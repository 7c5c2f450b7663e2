"""Experiment trackers (`trainer.loggers`): a job's records also go to TensorBoard, W&B and MLflow.

`TrackerSink` hands every record to the job's own sink first, then queues a copy for one background
thread that feeds the trackers, so a slow tracker never lengthens a step; a tracker that raises is
disabled. A tracker's run id is kept in `trackers.json` in the job's folder (a resumed job continues
the run) and beside each checkpoint (a fork links to its parent's run).

TensorBoard: event files under `<workdir>/tensorboard/`, samples as Markdown tables. W&B: online when
logged in (WANDB_API_KEY or `wandb login`), else offline under `<workdir>/wandb/`; WANDB_MODE decides
when set. MLflow: one run per job in the experiment `trainer.tracker_project`, at `trainer.mlflow_uri`,
else MLFLOW_TRACKING_URI, else `<workdir>/mlruns/` (MLflow 3 needs MLFLOW_ALLOW_FILE_STORE for a folder).
Each backend imports its library when opened.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from controller.sink import JobSink

log = logging.getLogger("tandem.trackers")

RUN_IDS_FILE = "trackers.json"


@dataclass
class RunInfo:
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

    def hyperparameters(self, step: int, changes: dict[str, Any]) -> None:
        """The edits beside their numbers, which went to `metrics` as "hparams/NAME" just before."""
        ...

    def samples(self, step: int, rows: list[dict[str, Any]]) -> None: ...

    def close(self) -> None: ...


def read_run_ids(folder: Path | None) -> dict[str, Any]:
    if folder is None:
        return {}
    try:
        return json.loads((Path(folder) / RUN_IDS_FILE).read_text())
    except (OSError, ValueError):
        return {}


def write_run_ids(folder: Path, ids: dict[str, Any]) -> None:
    """Atomically: a checkpoint copied by a fork never holds half a file."""
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
    """A step's stored samples as table columns and rows, the conversation as one text cell."""
    columns = ["step", "index", "prompt", "conversation", "reward", "finish_reason"]
    data = []
    for row in rows:
        talk = "\n".join(f"{turn['role']}: {turn['content']}" for turn in row.get("turns", []))
        data.append([step, row.get("index"), str(row.get("prompt", "")), talk, row.get("reward"),
                     row.get("finish_reason")])  # fmt: skip
    return columns, data


QUEUE_LIMIT = 10_000  # records waiting for the trackers at most; beyond it new ones are dropped
CLOSE_TIMEOUT_S = 60.0


class TensorBoardTracker:
    name = "tensorboard"

    def open(self, info: RunInfo) -> str:
        from torch.utils.tensorboard import SummaryWriter  # the tensorboard package writes the files

        self.logdir = info.workdir / "tensorboard"
        self.writer = SummaryWriter(log_dir=str(self.logdir), flush_secs=10)
        if not info.run_ids.get(self.name):  # the first start: the spec, and the parent of a fork
            self.writer.add_text("spec", "```\n" + json.dumps(info.config, indent=1) + "\n```", 0)
            if info.parent_job:
                self.writer.add_text("forked_from", info.parent_job, 0)
        return str(self.logdir)

    def metrics(self, step: int, values: dict[str, float]) -> None:
        for key, value in values.items():
            self.writer.add_scalar(key, value, step)

    def hyperparameters(self, step: int, changes: dict[str, Any]) -> None:
        self.writer.add_text("hyperparameters", json.dumps(changes), step)

    def samples(self, step: int, rows: list[dict[str, Any]]) -> None:
        columns, data = sample_table(step, rows)
        cell = lambda v: str(v).replace("|", "\\|").replace("\n", "<br>")  # noqa: E731
        lines = ["| " + " | ".join(columns) + " |", "|" + " --- |" * len(columns)]
        lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in data]
        self.writer.add_text("samples", "\n".join(lines), step)

    def close(self) -> None:
        self.writer.close()


def wandb_mode() -> str:
    if os.environ.get("WANDB_MODE"):
        return os.environ["WANDB_MODE"]
    netrc = Path.home() / ".netrc"
    logged_in = os.environ.get("WANDB_API_KEY") or (netrc.exists() and "api.wandb.ai" in netrc.read_text())
    return "online" if logged_in else "offline"


class WandbTracker:
    name = "wandb"

    def open(self, info: RunInfo) -> str:
        import wandb

        mode = wandb_mode()
        config = dict(info.config)
        tags = [info.job_id]
        if info.parent_ids.get(self.name):
            config["forked_from"] = {"job": info.parent_job, "wandb_run": info.parent_ids[self.name]}
            tags.append(f"fork-of-{info.parent_job}")
        self.run = wandb.init(
            project=info.project, id=info.run_ids.get(self.name) or info.job_id.replace("job-", ""),
            name=info.job_id, resume="allow", dir=str(info.workdir), config=config, tags=tags, mode=mode,
            reinit="create_new", settings=wandb.Settings(
                # No console capture, system-metrics sampler, git or package scan: they cost CPU that
                # the job's controller needs, and the job records its own logs and environment.
                silent=True, console="off", x_disable_stats=True, x_disable_meta=True,
                x_disable_machine_info=True, x_save_requirements=False, disable_git=True,
            ),
        )  # fmt: skip
        log.info("wandb: run %s (%s)", self.run.id, mode)
        return self.run.id

    def metrics(self, step: int, values: dict[str, float]) -> None:
        self.run.log(values, step=step)

    def hyperparameters(self, step: int, changes: dict[str, Any]) -> None:
        self.run.config.update(changes, allow_val_change=True)

    def samples(self, step: int, rows: list[dict[str, Any]]) -> None:
        import wandb

        columns, data = sample_table(step, rows)
        self.run.log({"samples": wandb.Table(columns=columns, data=data)}, step=step)

    def close(self) -> None:
        self.run.finish()


MAX_PARAM_CHARS = 500  # MLflow refuses longer param values
BATCH = 100  # MLflow's most params or metrics per log_batch call


def tracking_uri(info: RunInfo) -> str:
    uri = info.mlflow_uri or os.environ.get("MLFLOW_TRACKING_URI") or str(info.workdir / "mlruns")
    if "://" not in uri or uri.startswith("file:"):
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    return uri


class MlflowTracker:
    name = "mlflow"

    def open(self, info: RunInfo) -> str:
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient(tracking_uri=tracking_uri(info))
        if info.run_ids.get(self.name):  # a resumed job: the same run, running again
            self.run_id = info.run_ids[self.name]
            self.client.update_run(self.run_id, status="RUNNING")
            return self.run_id
        experiment = self.client.get_experiment_by_name(info.project)
        experiment_id = (
            experiment.experiment_id if experiment else self.client.create_experiment(info.project)
        )
        tags = {"tandem.job_id": info.job_id}
        if info.parent_ids.get(self.name):
            tags.update(
                {
                    "mlflow.parentRunId": info.parent_ids[self.name],
                    "tandem.forked_from": info.parent_job or "",
                }
            )
        self.run_id = self.client.create_run(experiment_id, run_name=info.job_id, tags=tags).info.run_id
        params = [Param(k, str(v)[:MAX_PARAM_CHARS]) for k, v in flatten(info.config).items()]
        for i in range(0, len(params), BATCH):
            self.client.log_batch(self.run_id, params=params[i : i + BATCH])
        return self.run_id

    def metrics(self, step: int, values: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        batch = [Metric(k, float(v), now, step) for k, v in values.items()]
        for i in range(0, len(batch), BATCH):
            self.client.log_batch(self.run_id, metrics=batch[i : i + BATCH])

    def hyperparameters(self, step: int, changes: dict[str, Any]) -> None:
        """Its numbers are metrics already; MLflow's params are the spec's, fixed once logged."""

    def samples(self, step: int, rows: list[dict[str, Any]]) -> None:
        columns, data = sample_table(step, rows)
        self.client.log_dict(self.run_id, {"columns": columns, "data": data}, f"samples/step_{step}.json")

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


def make_tracker(name: str) -> Tracker:
    """The tracker called `name` (a `trainer.loggers` entry)."""
    trackers = {"tensorboard": TensorBoardTracker, "wandb": WandbTracker, "mlflow": MlflowTracker}
    if name in trackers:
        return trackers[name]()
    raise ValueError(f"trainer.loggers: unknown tracker '{name}'; choose tensorboard, wandb or mlflow")


class TrackerSink:
    """A JobSink that also sends metrics, hyper-parameter changes and samples to trackers."""

    def __init__(self, inner: JobSink, trackers: list[Tracker], info: RunInfo) -> None:
        self.inner, self.info = inner, info
        self.trackers = trackers
        self.queue: queue.Queue = queue.Queue(maxsize=QUEUE_LIMIT)
        self.dropped = 0
        self.thread = threading.Thread(target=self._feed, name="tandem-trackers", daemon=True)
        self.thread.start()

    def event(self, kind: str, message: str, **data: Any) -> None:
        self.inner.event(kind, message, **data)
        if kind == "hyperparameters":
            self._put("hyperparameters", self._step_of(message), dict(data))
        elif kind == "checkpoint" and data.get("path"):
            self._put("checkpoint", data.get("step", 0), data["path"])

    def metrics(self, step: int, values: dict[str, float]) -> None:
        self.inner.metrics(step, values)
        self._put("metrics", step, dict(values))

    def samples(self, step: int, rows: list[dict[str, Any]]) -> None:
        self.inner.samples(step, rows)
        self._put("samples", step, rows)

    def __getattr__(self, name: str) -> Any:  # progress, flush, rewind: the job's sink alone (the
        return getattr(self.inner, name)  # trackers are a copy: a checkpoint never waits for them)

    def close(self, timeout_s: float = CLOSE_TIMEOUT_S) -> None:
        """Send what is queued, then close every tracker."""
        self._put("close", 0, None, block=True)
        self.thread.join(timeout_s)
        if self.thread.is_alive():
            log.warning("trackers: still sending after %.0f s; closing without the rest", timeout_s)

    def _put(self, kind: str, step: int, payload: Any, block: bool = False) -> None:
        try:
            self.queue.put((kind, step, payload), block=block, timeout=5 if block else None)
        except queue.Full:
            self.dropped += 1
            if self.dropped == 1:
                log.warning(
                    "trackers: %d records waiting; dropping new ones until they catch up", QUEUE_LIMIT
                )

    @staticmethod
    def _step_of(message: str) -> int:
        """The step of the trainer's 'applied at step N: ...'."""
        try:
            return int(message.split("step ", 1)[1].split(":", 1)[0])
        except (IndexError, ValueError):
            return 0

    def _feed(self) -> None:
        self._call_each("open", self.info, keep_ids=True)
        while True:
            kind, step, payload = self.queue.get()
            if kind == "close":
                self._call_each("close")
                return
            if kind == "checkpoint":  # a fork from this checkpoint will link to these runs
                self._save_ids(Path(payload))
                continue
            if kind == "hyperparameters":  # from the step it applies, as a metric "hparams/NAME"
                numbers = {f"hparams/{k}": v for k, v in payload.items() if isinstance(v, int | float)}
                if numbers:
                    self._call_each("metrics", step, numbers)
            self._call_each(kind, step, payload)

    def _call_each(self, method: str, *args: Any, keep_ids: bool = False) -> None:
        for tracker in list(self.trackers):
            try:
                result = getattr(tracker, method)(*args)
            except Exception as err:  # a tracker's failure is never the job's
                log.warning("tracker %s failed in %s (%s: %s); it is disabled for this run",
                            tracker.name, method, type(err).__name__, err)  # fmt: skip
                self.trackers.remove(tracker)
                continue
            if keep_ids:
                self.info.run_ids[tracker.name] = result
        if keep_ids:
            self._save_ids(self.info.workdir)

    def _save_ids(self, folder: Path) -> None:
        try:
            write_run_ids(folder, {**self.info.run_ids, "job": self.info.job_id})
        except OSError as err:  # a checkpoint pruned meanwhile: nothing to link from it
            log.debug("trackers: could not write run ids to %s: %s", folder, err)


def with_trackers(sink: JobSink, spec: Any, workdir: Path, job_id: str) -> JobSink:
    """`sink`, or a TrackerSink around it when `spec.trainer.loggers` names trackers."""
    names = list(dict.fromkeys(spec.trainer.loggers))
    if not names:
        return sink
    workdir = Path(workdir)
    parent = read_run_ids(Path(spec.checkpoint.resume_from)) if spec.checkpoint.resume_from else {}
    own = read_run_ids(workdir)
    if own.get("job") not in (None, job_id):
        own = {}
    info = RunInfo(
        job_id=job_id, workdir=workdir, project=spec.trainer.tracker_project,
        config=spec.model_dump(mode="json"), mlflow_uri=spec.trainer.mlflow_uri,
        run_ids={k: v for k, v in own.items() if k != "job"},
        parent_ids={k: v for k, v in parent.items() if k != "job"} if parent.get("job") != job_id else {},
        parent_job=parent.get("job") if parent.get("job") != job_id else None,
    )  # fmt: skip
    return TrackerSink(sink, [make_tracker(name) for name in names], info)
