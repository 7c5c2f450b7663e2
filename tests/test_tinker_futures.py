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


def test_an_owners_requests_count_until_answered_or_dropped_from_their_queue(tmp_path):
    """A cancelled op still holds its request in its queue: it counts until the dispatcher drops it."""
    from collections import OrderedDict, deque

    from service.tinker_hosts import Host, HostOptions, Op
    from service.tinker_requests import TinkerError
    from workers.session_host import SessionWorker

    table = FutureTable()
    host = Host("tiny-qwen2", tmp_path, table, HostOptions())
    queue = host._queues.setdefault("ann", OrderedDict()).setdefault("m", deque())
    for _ in range(2):
        queue.append(Op(table.create("ann", "forward", 2), "ann", "m", SessionWorker.optim_step, {}, {}))
    with pytest.raises(TinkerError) as refused:
        table.create("ann", "forward", 2)
    assert refused.value.status == 429 and refused.value.param == "tinker_max_pending_requests"
    table.create("bob", "forward", 2)  # another owner's count
    table.cancel(queue[0].future)
    with pytest.raises(TinkerError):
        table.create("ann", "forward", 2)
    [taken] = host._next_batch()  # the cancelled op is dropped, the other one runs
    extra = table.create("ann", "forward", 2)
    with pytest.raises(TinkerError):
        table.create("ann", "forward", 2)
    table.finish(taken.future, {})
    table.fail(extra, "failed")
    assert [table.create("ann", "forward", 2) for _ in range(2)]


def test_recorded_samples_are_bounded_per_owner_so_one_cannot_push_out_anothers(monkeypatch):
    from service.tinker_sessions import Records

    monkeypatch.setattr(tinker_sessions, "MAX_RECORDED_TOKENS", 10)
    records = Records()
    records.record("ann", ["ann:0"], [1, 2], [{"tokens": [3, 4], "logprobs": [-0.5, None]}])
    for i in range(20):  # bob samples a flood with record_stability_info
        records.record("bob", [f"bob:{i}"], [1, 2], [{"tokens": [3, 4]}])
    assert "ann:0" in records.sequences and list(records.sequences["ann:0"].tokens) == [3, 4]
    assert [k for k in records.sequences if k.startswith("bob")] == ["bob:18", "bob:19"]  # his newest
    records.record("ann", ["ann:1", "ann:2"], [1] * 6, [{"tokens": [5]}, {"tokens": [6]}])
    assert [k for k in records.sequences if k.startswith("ann")] == ["ann:2"]


def test_an_owners_unread_answers_are_bounded_oldest_dropped_first(clock, monkeypatch):
    """An answer nobody reads stays an hour: a client that never polls could pile them up (a forward's
    may be megabytes); past MAX_UNREAD its oldest go, and another owner's are not touched."""
    monkeypatch.setattr(tinker_sessions, "MAX_UNREAD", 2, raising=False)
    table = FutureTable()
    ann = [table.create("ann", "forward") for _ in range(4)]
    bob = table.create("bob", "forward")
    for future in [*ann, bob]:
        clock[0] += 1
        table.finish(future, {"ok": 1})
    table.read(ann[0])  # read: it goes after READ_KEEP_S, and does not count
    clock[0] += tinker_sessions.SWEEP_EVERY_S
    table.create("ann", "forward")
    assert [f.id in table for f in ann] == [True, False, True, True] and bob.id in table
