"""A service job's record reaches the store before a checkpoint past it is committed.

`BufferSink.flush` (called by the trainer before a checkpoint's commit rename) waits until the
service has stored every record made so far; a service restarted after a crash records the
checkpoints on disk that it had not heard of yet.
"""

from __future__ import annotations

import json
import logging
import threading
from pathlib import Path

from controller import checkpoints
from controller.job_actor import BufferSink
from engines.training.checkpoint_paths import step_dir
from service.job_state import JobStatus
from service.scheduler import Scheduler
from service.store import JobStore
from tests.api_util import tiny_job


def flush_in_thread(sink: BufferSink) -> threading.Thread:
    thread = threading.Thread(target=sink.flush, daemon=True)
    thread.start()
    return thread


def test_flush_waits_until_every_record_so_far_is_stored():
    sink = BufferSink()
    sink.metrics(1, {"actor/loss": 0.5})
    sink.samples(1, [{"response": "12"}])
    first = sink.drain()
    sink.metrics(2, {"actor/loss": 0.4})  # made after the first drain
    waiting = flush_in_thread(sink)
    waiting.join(0.3)
    assert waiting.is_alive()  # nothing stored yet
    sink.committed(first["seq"])
    waiting.join(0.3)
    assert waiting.is_alive()  # step 2's metrics are not in the store
    second = sink.drain()
    assert [m[1] for m in second["metrics"]] == [2] and second["seq"] == 3
    sink.committed(second["seq"])
    waiting.join(5)
    assert not waiting.is_alive()
    sink.committed(1)  # a late, older acknowledgement does not move it back
    again = flush_in_thread(sink)
    again.join(5)
    assert not again.is_alive()


def test_flush_goes_on_after_its_timeout_and_says_so(caplog):
    sink = BufferSink()
    sink.FLUSH_TIMEOUT_S = 0.2
    sink.event("resumed", "resumed from step 3", step=3)
    with caplog.at_level(logging.WARNING, logger="tandem.job"):
        sink.flush()
    assert "stored 0 of 1 records" in caplog.text


def test_a_restart_records_the_checkpoints_the_dead_service_missed(tmp_path: Path):
    store = JobStore(tmp_path / "t.db")
    job = store.create_job(tiny_job(), tmp_path / "jobs")
    assert store.transition(job.id, (JobStatus.QUEUED,), JobStatus.RUNNING)
    for step in range(1, 6):
        store.add_metrics(job.id, step, {"actor/loss": float(step)})
    root = checkpoints.root(Path(job.workdir))
    store.add_checkpoint(job.id, 2, str(step_dir(root, 2)))
    for step in (2, 4):  # step 4 was committed on disk; the service died before it stored the event
        step_dir(root, step).mkdir(parents=True)
        (step_dir(root, step) / checkpoints.STATE_FILE).write_text(json.dumps({"step": step}))
    step_dir(root, 5).mkdir()  # begun, never committed

    Scheduler(store)._recover()

    assert [c["step"] for c in store.checkpoints(job.id)] == [2, 4]
    record = store.get_job(job.id)
    assert record.status == JobStatus.QUEUED and record.step == 4
    kinds = [e["kind"] for e in store.events(job.id)]
    assert kinds[-2:] == ["checkpoint", "requeued"]
