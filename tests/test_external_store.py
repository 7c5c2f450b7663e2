"""The external trajectory store (controller/external_store.py): groups, the reward timeout, the
pending limit, forks. Plain Python: no Ray, no model."""

from __future__ import annotations

import pytest

from controller.external_store import Segment, TrajectoryError, TrajectoryStore
from schema.external import ExternalSpec


def store(**config) -> TrajectoryStore:
    return TrajectoryStore(ExternalSpec(**{"group_size": 2, "trajectories_per_step": 4, **config}))


def called(s: TrajectoryStore, tid: str) -> None:
    t = s.open(tid)
    seg = Segment(prompt_ids=[1, 2], kind="chat", reason="first call")
    seg.add_call([], [5, 6], [-0.5, -0.25], version=3)
    t.segments.append(seg)


def test_a_step_takes_whole_groups_of_one_task_only():
    s = store()
    for tid, task in [("a", "x"), ("b", "y"), ("c", "x")]:
        called(s, tid)
        s.reward(tid, 1.0, task, None, {})
    assert s.take() is None  # x has a group, y has one of two
    called(s, "d")
    s.reward("d", 0.0, "y", [0.0], {"k": "v"})
    rows = s.take()  # one row per segment, in the trainer's multi-turn layout
    assert sorted(r.trajectory_id for r in rows) == ["a", "b", "c", "d"]
    assert {s.trajectories[r.trajectory_id].state for r in rows} == {"consumed"} and s.consumed == 4
    d = next(r for r in rows if r.trajectory_id == "d")
    assert (d.task_id, d.reward, d.turns, d.weight_version, d.finish_reason) == ("y", 0.0, 1, 3, "done")
    assert (d.prompt_ids, d.tokens, d.loss_mask, d.log_probs) == ([1, 2], [5, 6], [1, 1], [-0.5, -0.25])
    with pytest.raises(TrajectoryError) as late:
        s.reward("a", 1.0, "x", None, {})
    assert late.value.status == 409


def test_a_trajectory_without_reward_in_time_is_dropped_and_counted():
    s = store(reward_timeout_s=5)
    called(s, "a")
    t = s.trajectories["a"]
    assert s.sweep(now=t.last_call + 4) == 0
    assert s.sweep(now=t.last_call + 6) == 1
    assert t.state == "dropped" and s.dropped == 1 and s.stats()["external/dropped_total"] == 1.0
    with pytest.raises(TrajectoryError) as refused:
        s.reward("a", 1.0, None, None, {})
    assert refused.value.status == 409 and refused.value.code == "trajectory_dropped"
    with pytest.raises(TrajectoryError) as unknown:
        s.reward("zzz", 1.0, None, None, {})
    assert unknown.value.status == 404


def test_past_max_pending_a_new_trajectory_is_a_429_but_open_ones_go_on():
    s = store(max_pending=2)
    called(s, "a")
    called(s, "b")
    with pytest.raises(TrajectoryError) as full:
        s.open("c")
    assert full.value.status == 429 and full.value.retry_after > 0 and "c" not in s.trajectories
    assert s.open("a") is s.trajectories["a"]  # a call of an open trajectory is always taken
    s.reward("a", 1.0, "x", None, {})
    s.reward("b", 1.0, "x", None, {})
    assert s.take() is None  # trajectories_per_step 4: still pending
    s.config = ExternalSpec(group_size=2, trajectories_per_step=2, max_pending=2)
    assert len(s.take()) == 2
    s.open("c")  # room again


def test_a_fork_copies_the_segments_before_the_call():
    s = store()
    called(s, "a")
    fork = s.fork("a.1", s.trajectories["a"].segments)
    fork.segments[0].add_call([9], [7], [-1.0], version=4)
    assert s.trajectories["a"].segments[0].tokens == [5, 6]
    assert fork.segments[0].tokens == [5, 6, 9, 7] and fork.segments[0].loss_mask == [1, 1, 0, 1]
    assert fork.segments[0].weight_versions == [3, 4]


def test_uneven_segments_leave_out_earlier_segments_never_a_last_one():
    from controller.external_source import whole_ranks

    rows = [
        Segment(trajectory_id=t, reason=str(k))
        for t, k in [("a", 0), ("a", 1), ("b", 0), ("c", 0), ("c", 1), ("d", 0)]
    ]
    assert whole_ranks(rows, 1) == rows
    kept = whole_ranks(rows, 4)
    assert [(r.trajectory_id, r.reason) for r in kept] == [("a", "1"), ("b", "0"), ("c", "1"), ("d", "0")]
