"""A cancel that lands while the scheduler is between two moves of the same job: the job still ends;
a start whose stored spec cannot be read fails naming why.

Each test places the user's cancel (the store move Service.cancel makes) inside the window it names;
on a live service the window is a few milliseconds wide, so the test puts the cancel there itself.
"""

from __future__ import annotations

from pathlib import Path

import ray

from service.files import FileStore
from service.job_state import JobStatus as S
from service.owned_paths import OwnedPaths
from service.scheduler import Scheduler
from service.scheduler_runs import RunningJob
from service.store import JobStore
from tests.api_util import tiny_job


@ray.remote(num_cpus=0)
class Finished:
    """Stands where a job's controller actor stood once its run returned (the scheduler kills it)."""

    def ping(self) -> bool:
        return True


def cancel(store: JobStore, job_id: str) -> None:
    assert store.transition(job_id, (S.RUNNING, S.PAUSING), S.CANCELLING)


def test_a_run_that_had_paused_when_its_cancel_came_ends_cancelled(ray_cluster, tmp_path: Path):
    store = JobStore(tmp_path / "t.db")
    scheduler = Scheduler(store, warm_controllers=0)
    job = store.create_job(tiny_job(), tmp_path / "jobs")
    assert store.transition(job.id, (S.QUEUED,), S.RUNNING)
    assert store.transition(job.id, (S.RUNNING,), S.PAUSING)  # pause asked; the run checkpoints and returns
    actor = Finished.remote()
    run = RunningJob(actor, ray.put({"status": "paused", "step": 2}), 1.0, 0.0, 0, job.owner)
    scheduler.running[job.id] = run
    cancel(store, job.id)  # before the scheduler settled the paused run

    scheduler._settle(job.id, run)

    record = store.get_job(job.id)
    assert record.status == S.CANCELLED
    assert store.events(job.id)[-1]["kind"] == "cancelled" and "step 2" in store.events(job.id)[-1]["message"]
    assert job.id not in scheduler.running


def test_a_start_refused_after_its_cancel_came_ends_failed_naming_why(tmp_path: Path):
    store = JobStore(tmp_path / "t.db")
    scheduler = Scheduler(store, warm_controllers=0)
    scheduler.paths = OwnedPaths(tmp_path, FileStore(tmp_path / "files"), store)  # set by the API
    job = store.create_job(tiny_job(data={"train_path": "file-0123456789ab"}), tmp_path / "jobs")
    real = scheduler.spec_to_run

    def cancelled_then_checked(record, own_checkpoint):  # the cancel lands between the two moves
        cancel(store, record.id)
        return real(record, own_checkpoint)

    scheduler.spec_to_run = cancelled_then_checked
    scheduler._launch(store.get_job(job.id), 1.0, 0.0)

    record = store.get_job(job.id)
    assert record.status == S.FAILED
    assert "no uploaded file 'file-0123456789ab'" in record.error
    assert [e["kind"] for e in store.events(job.id)][-1] == "failed"
    assert job.id not in scheduler.running


def test_a_stored_spec_that_no_longer_parses_fails_its_start_naming_the_field(tmp_path: Path):
    """A row whose spec this version cannot read (a section's field it no longer has) fails when the
    scheduler starts it, naming the field, instead of leaving it running with no run."""
    store = JobStore(tmp_path / "t.db")
    scheduler = Scheduler(store, warm_controllers=0)
    spec = tiny_job()
    spec["trainer"]["retired_knob"] = 1  # a field an older version had: sections forbid unknown fields
    job = store.create_job(spec, tmp_path / "jobs")
    scheduler._launch(store.get_job(job.id), 1.0, 0.0)

    record = store.get_job(job.id)
    assert record.status == S.FAILED and "trainer.retired_knob" in record.error, record.error
    assert job.id not in scheduler.running
