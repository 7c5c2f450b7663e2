"""The job's one staleness filter (controller/rollout_buffer.py `too_stale`) at its boundaries: a
sample exactly k versions old trains, one more is dropped and counted, whether the trainer takes one
draw (generated rollouts' lanes) or a step's worth of groups (the agents' endpoint), and the step's
staleness report refuses what the filter would have dropped."""

from __future__ import annotations

import pytest
import torch

from controller.batch_source import staleness_metrics
from controller.rollout_buffer import BufferedRollout, BufferTimeout, RolloutBuffer, too_stale
from workers.batch import Batch


@pytest.mark.parametrize(
    ("trainer_version", "sample_version", "k", "stale"),
    [
        (0, 0, 0, False),  # k = 0: only the trainer's own version trains
        (1, 0, 0, True),
        (5, 3, 2, False),  # exactly k old: kept
        (5, 2, 2, True),  # k + 1 old: dropped
        (3, 4, 0, False),  # newer than the trainer (a lane's call after a sync): never stale
    ],
)
def test_too_stale_is_staleness_past_k(trainer_version, sample_version, k, stale):
    assert too_stale(trainer_version, sample_version, k) is stale


def buffer_with(versions: list[int], k: int, samples: int = 2) -> RolloutBuffer:
    """A buffer of k, one item of `samples` per version (admitted, then put, as a producer does)."""
    buffer = RolloutBuffer(samples, k, capacity=samples * (len(versions) + 1))
    buffer.set_version(max(versions))  # the producers' weights: admission lets every item in
    for index, version in enumerate(versions):
        assert buffer.try_admit(samples) is None
        buffer.put(BufferedRollout(index, samples, version))
    return buffer


def test_take_drops_exactly_the_items_past_k_and_gives_their_room_back():
    buffer = buffer_with([0, 1, 2], k=1)
    accepted = buffer.accepted
    taken, dropped = buffer.take(2, 2, 1.0, "test")
    assert dropped == 2 and [t.version for t in taken] == [1]  # 2 - 1 == k: trained
    assert buffer.dropped == 2 and buffer.accepted == accepted - 2  # the producers may replace them
    taken, dropped = buffer.take(2, 2, 1.0, "test")
    assert ([t.version for t in taken], dropped) == ([2], 0)


def test_a_step_of_groups_is_taken_whole_or_not_at_all_after_the_filter():
    """The agents' endpoint: items are groups, several a step; none is taken while short of a step."""
    buffer = buffer_with([0, 1, 1], k=1)
    with pytest.raises(BufferTimeout, match="test: no rollout ready"):
        buffer.take(2, 6, 0.0, "test")  # v0 dropped; 4 samples left of 6 wanted
    assert buffer.dropped == 2 and buffer.pending_indices() == [1, 2]
    taken, dropped = buffer.take(2, 4, 0.0, "test")
    assert [(t.index, t.version) for t in taken] == [(1, 1), (2, 1)] and dropped == 0
    assert buffer.buffered_samples() == 0
    with pytest.raises(BufferTimeout):  # k = 0: one version old is dropped
        buffer_with([3], k=0).take(4, 2, 0.0, "test")


def versions_batch(versions: list[int]) -> Batch:
    return Batch.from_dict({"policy_version": torch.tensor(versions, dtype=torch.long)})


def test_the_staleness_report_counts_ages_up_to_k_and_refuses_older():
    metrics = staleness_metrics({}, versions_batch([4, 3, 2, 2]), version=4, k=2)
    assert [metrics[f"async/staleness_hist/{age}"] for age in range(3)] == [1.0, 1.0, 2.0]
    assert metrics["async/staleness_max"] == 2.0 and metrics["async/staleness_mean"] == pytest.approx(1.25)
    with pytest.raises(RuntimeError, match="staleness 3 reached the update"):
        staleness_metrics({}, versions_batch([4, 1]), version=4, k=2)
