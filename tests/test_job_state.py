"""The job state machine: the one transition table, and the store refusing any move outside it."""

from __future__ import annotations

import itertools
import stat
from pathlib import Path

import pytest

from service.job_state import ACTIVE, TERMINAL, TRANSITIONS, JobStatus, allowed
from service.store import JobStore
from tests.api_util import tiny_job

S = JobStatus
ALLOWED = [
    (S.QUEUED, S.RUNNING), (S.QUEUED, S.PAUSED), (S.QUEUED, S.CANCELLED),
    (S.RUNNING, S.PAUSING), (S.RUNNING, S.PAUSED), (S.RUNNING, S.CANCELLING), (S.RUNNING, S.QUEUED),
    (S.RUNNING, S.SUCCEEDED), (S.RUNNING, S.FAILED), (S.RUNNING, S.CANCELLED),
    (S.PAUSING, S.PAUSED), (S.PAUSING, S.CANCELLING), (S.PAUSING, S.QUEUED), (S.PAUSING, S.SUCCEEDED),
    (S.PAUSING, S.FAILED), (S.PAUSING, S.CANCELLED),
    (S.CANCELLING, S.CANCELLED), (S.CANCELLING, S.SUCCEEDED), (S.CANCELLING, S.FAILED),
    (S.PAUSED, S.QUEUED), (S.PAUSED, S.CANCELLED),
]  # fmt: skip
FORBIDDEN = [
    (S.SUCCEEDED, S.QUEUED), (S.FAILED, S.RUNNING), (S.CANCELLED, S.QUEUED), (S.PAUSED, S.RUNNING),
    (S.QUEUED, S.SUCCEEDED), (S.QUEUED, S.PAUSING), (S.CANCELLING, S.QUEUED), (S.CANCELLING, S.PAUSED),
    (S.PAUSED, S.PAUSING), (S.QUEUED, S.QUEUED),
]  # fmt: skip


def test_the_table_lists_exactly_the_allowed_moves():
    listed = {(a, b) for a, nexts in TRANSITIONS.items() for b in nexts}
    assert listed == set(ALLOWED)
    assert set(TRANSITIONS) == set(JobStatus)
    assert set(TERMINAL) == {S.SUCCEEDED, S.FAILED, S.CANCELLED}
    assert not set(TERMINAL) & set(ACTIVE)


@pytest.mark.parametrize(("source", "target"), ALLOWED)
def test_every_allowed_move_happens_in_the_store(tmp_path: Path, source: JobStatus, target: JobStatus):
    store = JobStore(tmp_path / "t.db")
    job = store.create_job(tiny_job(), tmp_path / "jobs")
    store.update_job(job.id, status=source)
    assert store.transition(job.id, (source,), target)
    assert store.get_job(job.id).status == target


@pytest.mark.parametrize(("source", "target"), FORBIDDEN)
def test_a_forbidden_move_is_refused_before_the_store_changes(tmp_path: Path, source, target):
    assert not allowed(source, target)
    store = JobStore(tmp_path / "t.db")
    job = store.create_job(tiny_job(), tmp_path / "jobs")
    store.update_job(job.id, status=source)
    with pytest.raises(ValueError, match=f"{source}->{target}"):
        store.transition(job.id, (source,), target)
    assert store.get_job(job.id).status == source


def test_a_move_from_another_status_does_nothing(tmp_path: Path):
    store = JobStore(tmp_path / "t.db")
    job = store.create_job(tiny_job(), tmp_path / "jobs")
    assert not store.transition(job.id, (S.PAUSED,), S.QUEUED)  # it is queued, not paused
    assert store.get_job(job.id).status == S.QUEUED


def test_no_path_leaves_a_terminal_status():
    for source, target in itertools.product(TERMINAL, JobStatus):
        assert not allowed(source, target)


def test_active_time_and_first_start_survive_a_resume(tmp_path: Path):
    store = JobStore(tmp_path / "t.db")
    job = store.create_job(tiny_job(), tmp_path / "jobs")
    store.transition(job.id, (S.QUEUED,), S.RUNNING)
    store.started(job.id, 1000.0)
    store.update_job(job.id, run_started_at=1000.0)
    store.transition(job.id, (S.RUNNING,), S.PAUSING)  # still running: the run goes on
    assert store.get_job(job.id).run_started_at == 1000.0
    store.transition(job.id, (S.PAUSING,), S.PAUSED)
    paused = store.get_job(job.id)
    assert paused.run_started_at is None and paused.active_s > 1000  # now - 1000
    first_run = paused.active_s
    store.transition(job.id, (S.PAUSED,), S.QUEUED)
    store.transition(job.id, (S.QUEUED,), S.RUNNING)
    store.started(job.id, 5000.0)
    resumed = store.get_job(job.id)
    assert resumed.started_at == 1000.0  # the first start, not the resume
    assert resumed.active_s == first_run and resumed.run_started_at is not None
    assert resumed.active_seconds(now=resumed.run_started_at + 7) == pytest.approx(first_run + 7)


def test_the_database_file_is_private(tmp_path: Path):
    store = JobStore(tmp_path / "t.db")
    store.create_job(tiny_job(), tmp_path / "jobs")  # writes through the WAL
    for name in ("t.db", "t.db-wal", "t.db-shm"):
        assert stat.S_IMODE((tmp_path / name).stat().st_mode) == 0o600, name
    (tmp_path / "old.db").touch(mode=0o644)  # a database made before this rule
    JobStore(tmp_path / "old.db")
    assert stat.S_IMODE((tmp_path / "old.db").stat().st_mode) == 0o600
