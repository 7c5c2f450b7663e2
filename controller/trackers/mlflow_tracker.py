"""MLflow: one run per job in the experiment `trainer.tracker_project`, at `trainer.mlflow_uri`,
else MLFLOW_TRACKING_URI, else `mlruns/` in the job's folder. A server (http://...) or a local folder
works; a local folder uses MLflow's file store (MLFLOW_ALLOW_FILE_STORE is set for it, since MLflow
3 asks for a database otherwise). The spec goes in as params, metrics by step, a hyper-parameter
change as a metric `hparams/NAME`, stored samples as JSON table artifacts (`samples/step_N.json`,
{"columns", "data"}). A fork's run carries its parent's run id as the tag `mlflow.parentRunId`.
"""

from __future__ import annotations

import os
import time
from typing import Any

from controller.trackers.base import RunInfo, flatten, sample_table

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
        numbers = {f"hparams/{k}": v for k, v in changes.items() if isinstance(v, int | float)}
        if numbers:
            self.metrics(step, numbers)

    def samples(self, step: int, rows: list[dict[str, Any]]) -> None:
        columns, data = sample_table(step, rows)
        self.client.log_dict(self.run_id, {"columns": columns, "data": data}, f"samples/step_{step}.json")

    def close(self) -> None:
        self.client.set_terminated(self.run_id)
