"""A cancel that lands while the scheduler is between two moves of the same job: the job still ends;
a start whose stored spec cannot be read fails naming why; a controller that stops answering is ended.

Each test places the user's cancel (the store move Service.cancel makes) inside the window it names;
on a live service the window is a few milliseconds wide, so the test puts the cancel there itself.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
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


@ray.remote(num_cpus=0, max_concurrency=4)
class Silent:
    """Stands for a job's controller actor: its run never ends; its drains answer until it is stopped."""

    def run(self) -> dict:
        threading.Event().wait()
        return {}

    def drain(self) -> dict:
        return {
            "events": [],
            "metrics": [],
            "samples": [],
            "checkpoints": [],
            "logs": [],
            "step": 0,
            "seq": 0,
        }

    def committed(self, seq: int) -> None:
        pass

    def pid(self) -> int:
        return os.getpid()


def test_a_controller_that_stops_answering_is_ended_naming_it_and_the_loop_goes_on(
    ray_cluster, tmp_path: Path
):
    """A hung controller (SIGSTOP) answered no drain: each scheduler pass waited 30 s on it, and the job
    stayed running for ever. Now a pass waits briefly, and past CONTROLLER_SILENT_S the controller is
    killed and its job requeued (a controller's loss), its event naming the controller and the wait."""
    store = JobStore(tmp_path / "t.db")
    scheduler = Scheduler(store, warm_controllers=0)
    scheduler.DRAIN_WAIT_S, scheduler.CONTROLLER_SILENT_S = 0.25, 1.0
    job = store.create_job(tiny_job(), tmp_path / "jobs")
    assert store.transition(job.id, (S.QUEUED,), S.RUNNING)
    actor = Silent.remote()
    pid = ray.get(actor.pid.remote(), timeout=30)
    scheduler.running[job.id] = RunningJob(actor, actor.run.remote(), 1.0, 0.0, 0, job.owner)
    scheduler._collect()  # answered: nothing to settle
    os.kill(pid, signal.SIGSTOP)
    try:
        deadline = time.monotonic() + 20

        def passes_until_settled() -> None:
            while job.id in scheduler.running and time.monotonic() < deadline:
                scheduler._collect()

        passes = threading.Thread(target=passes_until_settled, daemon=True)
        passes.start()
        passes.join(timeout=25)
        assert not passes.is_alive(), "a scheduler pass is still waiting on the stopped controller"
        record = store.get_job(job.id)
        assert record.status == S.QUEUED and job.id not in scheduler.running
        restart = [e for e in store.events(job.id) if e["kind"] == "restart"][-1]
        assert "the job's controller answered no drain for 1 s" in restart["message"], restart["message"]
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
