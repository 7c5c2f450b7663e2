"""The Tinker API's future table: a finished future stays readable for KEEP_S, then a later request's
sweep drops it; sweeps run at most every SWEEP_EVERY_S, not on every request."""

from __future__ import annotations

import pytest

from service import tinker_sessions
from service.tinker_sessions import FutureTable


@pytest.fixture
def clock(monkeypatch) -> list[float]:
    now = [1000.0]
    monkeypatch.setattr(tinker_sessions.time, "time", lambda: now[0])
    return now


def test_finished_futures_go_after_their_keep_time_and_pending_ones_stay(clock):
    table = FutureTable()
    done, pending = table.create("ann", "forward"), table.create("ann", "sample")
    table.finish(done, {"ok": 1})
    clock[0] += tinker_sessions.KEEP_S - 1
    table.create("ann", "forward")
    assert table.find(done.id, "ann") is done  # still within its keep time
    clock[0] += tinker_sessions.SWEEP_EVERY_S
    table.create("ann", "forward")
    assert done.id not in table and pending.id in table


def test_a_request_between_sweeps_leaves_the_table_alone(clock, monkeypatch):
    monkeypatch.setattr(tinker_sessions, "KEEP_S", 1.0)
    table = FutureTable()
    table.create("ann", "forward")  # the first sweep
    expired = table.create("ann", "forward")
    table.finish(expired, {"ok": 1})
    clock[0] += 2 * tinker_sessions.KEEP_S
    table.create("ann", "forward")
    assert expired.id in table  # expired, but the last sweep was under SWEEP_EVERY_S ago
    clock[0] += tinker_sessions.SWEEP_EVERY_S
    table.create("ann", "forward")
    assert expired.id not in table
