"""The tracker backends, each a thin adapter to its library (imported when opened).

TensorBoard: event files under `<workdir>/tensorboard/`, samples as Markdown tables. W&B: online when
logged in (WANDB_API_KEY or `wandb login`), else offline under `<workdir>/wandb/`; WANDB_MODE decides
when set. MLflow: one run per job in the experiment `trainer.tracker_project`, at `trainer.mlflow_uri`,
else MLFLOW_TRACKING_URI, else `<workdir>/mlruns/` (MLflow 3 needs MLFLOW_ALLOW_FILE_STORE for a folder).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from controller.trackers import RunInfo, flatten, log, sample_table


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
