"""The metrics series in SQLite: one row per step, replaced on re-run, read in pages and downsampled.

Every selection is checked against the same selection done in plain Python over the rows written.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from service.store import JobStore, MetricsQuery
from service.store_metrics import evenly, pick_keys
from tests.api_util import tiny_job

STEPS = list(range(0, 101))  # step 0 (validation) to 100


def values_at(step: int) -> dict[str, float]:
    return {"actor/loss": step / 10, "actor/lr": 1e-3, "critic/score/mean": step % 7, "timing/gen": 0.5}


@pytest.fixture()
def series(tmp_path: Path) -> tuple[JobStore, str]:
    store = JobStore(tmp_path / "t.db")
    job = store.create_job(tiny_job(), tmp_path / "jobs")
    for step in STEPS:
        store.add_metrics(job.id, step, values_at(step))
    return store, job.id


def steps(store: JobStore, job_id: str, **query) -> list[int]:
    return [r["step"] for r in store.metrics_page(job_id, MetricsQuery(**query))[0]]


def test_key_selection_by_name_and_prefix(series):
    store, job_id = series
    rows, _ = store.metrics_page(job_id, MetricsQuery(keys=("actor/*", "timing/gen")))
    assert set(rows[5]["values"]) == {"actor/loss", "actor/lr", "timing/gen"}
    assert rows[5]["values"]["actor/loss"] == pytest.approx(0.5)
    assert pick_keys({"a/x": 1, "ab": 2, "b": 3}, ("a/*", "b")) == {"a/x": 1, "b": 3}


def test_windows_last_every_and_paging(series):
    store, job_id = series
    assert steps(store, job_id, after_step=95) == [96, 97, 98, 99, 100]
    assert steps(store, job_id, step_min=10, step_max=12) == [10, 11, 12]
    assert steps(store, job_id, last=3) == [98, 99, 100]
    assert steps(store, job_id, every=25) == [0, 25, 50, 75, 100]
    assert steps(store, job_id, every=10, last=2) == [90, 100]
    first, more = store.metrics_page(job_id, MetricsQuery(limit=40))
    assert more and [r["step"] for r in first] == STEPS[:40]
    pages, cursor = [r["step"] for r in first], first[-1]["step"]
    while True:  # after_step is the cursor of the next page
        page, more = store.metrics_page(job_id, MetricsQuery(after_step=cursor, limit=40))
        pages += [r["step"] for r in page]
        if not more:
            break
        cursor = page[-1]["step"]
    assert pages == STEPS


@pytest.mark.parametrize("points", [1, 2, 3, 10, 50, 101, 500])
def test_max_points_is_even_and_keeps_the_last(series, points: int):
    store, job_id = series
    got = steps(store, job_id, max_points=points)
    assert len(got) == min(points, len(STEPS)) and got[-1] == 100
    assert got == sorted(set(got))
    if 2 <= points < len(STEPS):
        gaps = [b - a for a, b in zip(got, got[1:], strict=False)]
        assert got[0] == 0 and max(gaps) - min(gaps) <= 1  # evenly spread over 0..100
    assert evenly(list(range(10)), 4) == [0, 3, 6, 9]


def test_a_rerun_step_replaces_its_row_and_a_truncate_forgets_the_crashed_tail(series):
    store, job_id = series
    store.truncate_after(job_id, 35)  # the run crashed at 100; it resumes from the checkpoint at 35
    job = store.get_job(job_id)
    assert job.step == 35 and job.latest_metrics == values_at(35)
    assert steps(store, job_id)[-1] == 35
    newest_id = store.metrics_since(job_id)[-1]["id"]
    store.add_metrics(job_id, 35, {"actor/loss": -1.0})  # the same step written again
    store.add_metrics(job_id, 36, {"actor/loss": -2.0})
    rows = store.metrics_page(job_id, MetricsQuery(step_min=35))[0]
    assert [(r["step"], r["values"]) for r in rows] == [
        (35, {"actor/loss": -1.0}),
        (36, {"actor/loss": -2.0}),
    ]
    assert [r["step"] for r in store.metrics_since(job_id, newest_id)] == [35, 36]  # a stream sees both
    with sqlite3.connect(store.path) as db:
        counts = db.execute("SELECT step, COUNT(*) FROM metrics GROUP BY step HAVING COUNT(*) > 1").fetchall()
    assert counts == []


def test_an_old_database_with_duplicate_steps_keeps_the_newest_row(tmp_path: Path):
    path = tmp_path / "old.db"
    with sqlite3.connect(path) as db:  # the first schema: no unique step per job
        db.execute("CREATE TABLE metrics (id INTEGER PRIMARY KEY AUTOINCREMENT, job_id TEXT NOT NULL, "
                   "step INTEGER NOT NULL, time REAL NOT NULL, data TEXT NOT NULL)")  # fmt: skip
        db.execute("CREATE INDEX metrics_job ON metrics(job_id, step)")
        for data in ('{"a": 1}', '{"a": 2}'):
            db.execute("INSERT INTO metrics (job_id, step, time, data) VALUES ('j', 5, 0, ?)", (data,))
    store = JobStore(path)
    assert [r["values"] for r in store.metrics_page("j")[0]] == [{"a": 2}]
