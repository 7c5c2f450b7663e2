"""Experiment trackers (controller/trackers.py): TensorBoard, W&B (offline) and MLflow (a local folder)
receive a job's metrics, hyper-parameter changes and samples, read back with each library's reader.

The TrackerSink is driven directly with the records a trainer makes (the job's own JsonlSink inside),
through a resume of the same job and a fork of it; one job runs end to end through the service.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import pytest

from api.settings import ServeSettings
from controller.sink import JsonlSink
from controller.trackers import RUN_IDS_FILE, TrackerSink, with_trackers
from schema.job import JobSpec
from tests.api_util import start_service, tiny_job, wait_for
from tests.tracker_records import (
    mlflow_client,
    tensorboard_scalars,
    tensorboard_texts,
    wandb_config,
    wandb_history,
    wandb_records,
    wandb_run_files,
    wandb_run_ids,
    wandb_tables,
)

ALL = ["tensorboard", "wandb", "mlflow"]
MLFLOW_SERVER = "mlflow.example.internal:5000"
SAMPLE = {"index": 0, "prompt": "1+2=", "turns": [{"role": "assistant", "content": "3"}], "reward": 1.0,
          "finish_reason": "stop"}  # fmt: skip


@pytest.fixture(scope="module")
def live(ray_cluster, tmp_path_factory):
    """The suite's live service, its operator allowing W&B and one MLflow server (tandem serve
    --allow-wandb --allow-tracker-host)."""
    settings = ServeSettings(allow_wandb=True, tracker_hosts=[MLFLOW_SERVER])
    svc = start_service(tmp_path_factory.mktemp("service"), settings=settings)
    yield svc
    svc.stop()


@pytest.fixture(autouse=True)
def offline(monkeypatch) -> None:
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)


def spec_for(loggers: list[str], mlflow_uri: str, **checkpoint) -> JobSpec:
    return JobSpec.model_validate({"model": {"builtin": "tiny-qwen2"}, "checkpoint": checkpoint,
                                   "trainer": {"loggers": loggers, "mlflow_uri": mlflow_uri}})  # fmt: skip


def run_steps(sink: TrackerSink, steps: range, lr_change_at: int | None = None) -> None:
    """What a trainer sends: metrics every step, samples, a hyper-parameter change, a checkpoint."""
    for step in steps:
        if step == lr_change_at:
            sink.event("hyperparameters", f"applied at step {step}: {{'lr': 0.0005}}", lr=0.0005)
        sink.metrics(step, {"critic/score/mean": step / 10, "actor/lr": 0.001})
        if step % 2 == 0:
            sink.samples(step, [SAMPLE])
    sink.close()


def test_three_trackers_get_every_step_and_a_resumed_job_continues_its_runs(tmp_path: Path) -> None:
    workdir, uri = tmp_path / "job-a", str(tmp_path / "mlruns")
    spec = spec_for(ALL, uri)
    first = with_trackers(JsonlSink(workdir), spec, workdir, "job-a")
    run_steps(first, range(1, 5), lr_change_at=3)
    ids = json.loads((workdir / RUN_IDS_FILE).read_text())
    assert set(ids) == {"job", *ALL} and first.trackers and len(first.trackers) == 3

    # the job's own records are untouched by the wrapper
    own = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in own] == [1, 2, 3, 4]

    second = with_trackers(JsonlSink(workdir), spec, workdir, "job-a")  # the job resumed
    run_steps(second, range(5, 7))
    assert json.loads((workdir / RUN_IDS_FILE).read_text()) == ids  # the same runs continued

    tb = workdir / "tensorboard"
    assert tensorboard_scalars(tb, "critic/score/mean") == [(s, pytest.approx(s / 10)) for s in range(1, 7)]
    assert tensorboard_scalars(tb, "hparams/lr") == [(3, pytest.approx(0.0005))]
    assert [step for step, _ in tensorboard_texts(tb, "samples")] == [2, 4, 6]
    assert "1+2=" in tensorboard_texts(tb, "samples")[0][1]

    history = wandb_history(workdir)
    assert {s: history[s]["critic/score/mean"] for s in range(1, 7)} == {
        s: pytest.approx(s / 10) for s in range(1, 7)
    }
    assert history[3]["hparams/lr"] == pytest.approx(0.0005)
    assert wandb_run_ids(workdir) == {ids["wandb"]}  # both starts wrote the one run
    assert wandb_config(workdir)["lr"] == pytest.approx(0.0005)
    table = wandb_tables(workdir)[0]
    assert table["columns"][:3] == ["step", "index", "prompt"] and table["data"][0][2] == "1+2="

    client = mlflow_client(uri)
    points = client.get_metric_history(ids["mlflow"], "critic/score/mean")
    assert [(m.step, m.value) for m in points] == [(s, pytest.approx(s / 10)) for s in range(1, 7)]
    run = client.get_run(ids["mlflow"])
    assert run.data.params["optim.lr"] == str(spec.optim.lr) and run.info.status == "FINISHED"
    assert [(m.step, m.value) for m in client.get_metric_history(ids["mlflow"], "hparams/lr")] == [
        (3, 0.0005)
    ]
    artifacts = {a.path for a in client.list_artifacts(ids["mlflow"], "samples")}
    assert artifacts == {f"samples/step_{s}.json" for s in (2, 4, 6)}


def test_the_runs_go_to_the_tracker_project(tmp_path: Path) -> None:
    """trainer.tracker_project names the W&B project and the MLflow experiment of the job's runs."""
    workdir, uri = tmp_path / "job-t", str(tmp_path / "mlruns")
    spec = spec_for(["wandb", "mlflow"], uri).merged({"trainer": {"tracker_project": "arith-sweep"}})
    run_steps(with_trackers(JsonlSink(workdir), spec, workdir, "job-t"), range(1, 2))
    ids = json.loads((workdir / RUN_IDS_FILE).read_text())
    client = mlflow_client(uri)
    assert client.get_experiment(client.get_run(ids["mlflow"]).info.experiment_id).name == "arith-sweep"
    runs = [r.run for f in wandb_run_files(workdir) for r in wandb_records(f) if r.HasField("run")]
    assert runs and {r.project for r in runs} == {"arith-sweep"}


def test_a_fork_links_its_runs_to_its_parents(tmp_path: Path) -> None:
    uri = str(tmp_path / "mlruns")
    parent_dir, checkpoint = tmp_path / "job-p", tmp_path / "job-p" / "checkpoints" / "step_2"
    checkpoint.mkdir(parents=True)
    parent = with_trackers(JsonlSink(parent_dir), spec_for(["wandb", "mlflow"], uri), parent_dir, "job-p")
    parent.event("checkpoint", "saved step 2", path=str(checkpoint), step=2)
    run_steps(parent, range(1, 3))
    parent_ids = json.loads((checkpoint / RUN_IDS_FILE).read_text())
    assert parent_ids["job"] == "job-p" and parent_ids["mlflow"]

    child_dir = tmp_path / "job-c"
    spec = spec_for(["wandb", "mlflow"], uri, resume_from=str(checkpoint))
    run_steps(with_trackers(JsonlSink(child_dir), spec, child_dir, "job-c"), range(3, 5))
    child_ids = json.loads((child_dir / RUN_IDS_FILE).read_text())
    assert child_ids["mlflow"] != parent_ids["mlflow"] and child_ids["wandb"] != parent_ids["wandb"]
    tags = mlflow_client(uri).get_run(child_ids["mlflow"]).data.tags
    assert tags["mlflow.parentRunId"] == parent_ids["mlflow"] and tags["tandem.forked_from"] == "job-p"
    assert wandb_config(child_dir)["forked_from"] == {"job": "job-p", "wandb_run": parent_ids["wandb"]}


def test_a_failing_tracker_is_logged_and_disabled_and_the_job_goes_on(
    tmp_path: Path, monkeypatch, caplog
) -> None:
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "2")
    workdir = tmp_path / "job-f"
    spec = spec_for(["mlflow", "tensorboard"], "http://127.0.0.1:9")  # nothing listens on port 9
    sink = with_trackers(JsonlSink(workdir), spec, workdir, "job-f")
    with caplog.at_level(logging.WARNING, logger="tandem.trackers"):
        started = time.monotonic()
        for step in range(1, 4):
            sink.metrics(step, {"critic/score/mean": 0.5})
        handed_over = time.monotonic() - started
        sink.close()
    assert handed_over < 0.5  # the trainer never waited on the unreachable server
    assert any("tracker mlflow failed in open" in r.getMessage() for r in caplog.records)
    assert [t.name for t in sink.trackers] == ["tensorboard"]
    assert [s for s, _ in tensorboard_scalars(workdir / "tensorboard", "critic/score/mean")] == [1, 2, 3]
    assert len((workdir / "metrics.jsonl").read_text().splitlines()) == 3


def test_no_loggers_means_no_wrapper_and_unknown_ones_are_refused(tmp_path: Path) -> None:
    inner = JsonlSink(tmp_path)
    assert with_trackers(inner, JobSpec(), tmp_path, "job-n") is inner
    with pytest.raises(ValueError, match="trainer.loggers"):
        JobSpec.model_validate({"trainer": {"loggers": ["neptune"]}})


def test_a_local_mlflow_folder_outside_the_allowed_ones_is_refused_at_the_door(api) -> None:
    spec = tiny_job(trainer={"loggers": ["mlflow"], "mlflow_uri": "file:///etc/tandem-mlruns"})
    for uri, code in (("file:///etc/tandem-mlruns", "path_not_allowed"),
                      ("http://mlflow.example.internal:5001", "tracker_not_allowed")):  # fmt: skip
        spec["trainer"]["mlflow_uri"] = uri
        refused = api.post("/v1/jobs/validate", json=spec).json()["error"]
        assert (refused["param"], refused["code"]) == ("trainer.mlflow_uri", code), refused
    spec["trainer"]["mlflow_uri"] = f"http://{MLFLOW_SERVER}"  # a server the operator allows
    assert api.post("/v1/jobs/validate", json=spec).status_code == 200


# make test-slow; in make test the three trackers get every step of a job
# (test_three_trackers_get_every_step_and_a_resumed_job_continues_its_runs) and the service's own door
# for them is tested (test_a_local_mlflow_folder_outside_the_allowed_ones_is_refused_at_the_door).
@pytest.mark.slow
def test_a_service_job_logs_to_all_three_trackers(live, api) -> None:
    spec = tiny_job(trainer={"total_steps": 3, "loggers": ALL}, metadata={"suite": "trackers"})
    created = api.post("/v1/jobs", json=spec)
    assert created.status_code == 201, created.text
    job = wait_for(api, created.json()["id"], ("succeeded", "failed"), timeout_s=300)
    assert job["status"] == "succeeded", job.get("error")
    workdir = live.service.jobs_root / job["id"]
    ids = json.loads((workdir / RUN_IDS_FILE).read_text())
    assert [s for s, _ in tensorboard_scalars(workdir / "tensorboard", "critic/score/mean")] == [1, 2, 3]
    assert {1, 2, 3} <= set(wandb_history(workdir)) and ids["wandb"] in wandb_run_ids(workdir)
    points = mlflow_client(str(workdir / "mlruns")).get_metric_history(ids["mlflow"], "critic/score/mean")
    assert [m.step for m in points] == [1, 2, 3]
