"""The endpoint's batcher across re-attaches: a call the batcher had taken while every replica was busy
is served by the new replicas, a replica of an earlier attempt never serves again, and a replica's
answer the batcher cannot read is an answer to the caller too, never a wait without end.

The replicas are small Ray actors standing in for rollout workers: a real rollout worker cannot be held
busy on cue, and what is tested is the batcher's concurrency, not generation."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest
import ray

from controller.external_batcher import ReplicaBatcher
from controller.external_store import TrajectoryError
from engines.rollout import SamplingParams

pytestmark = pytest.mark.usefixtures("ray_cluster")
ANSWER_S = 20.0  # a call the batcher lost would wait for ever: bounded here so that the test fails


@ray.remote(num_cpus=0)
class Replica:
    """A rollout worker's `execute` surface: completions that name this replica, held while `hold` is
    set (busy on cue), or an answer of the wrong shape when told to."""

    def __init__(self, name: str) -> None:
        self.name, self.gate, self.garbled = name, asyncio.Event(), False
        self.gate.set()

    async def execute(self, method: str, args: tuple) -> Any:
        if method == "weight_version":
            return 0
        await self.gate.wait()
        if self.garbled:
            return None
        prompts, params = args[0]
        return [
            SimpleNamespace(weight_version=0, replica=self.name) for _ in prompts for _ in range(params["n"])
        ]

    async def hold(self, held: bool, garbled: bool = False) -> None:
        self.garbled = garbled
        self.gate.clear() if held else self.gate.set()


@pytest.fixture(scope="module")
def started() -> dict[str, Any]:
    made = {name: Replica.remote(name) for name in ("old", "new")}
    ray.get([r.hold.remote(False) for r in made.values()], timeout=60)
    return made


@pytest.fixture
def replicas(started: dict[str, Any]) -> tuple[Any, Any]:
    """Two idle replicas, "old" and "new", each answering."""
    ray.get([r.hold.remote(False) for r in started.values()], timeout=30)
    return started["old"], started["new"]


async def served_by(batcher: ReplicaBatcher, call: asyncio.Future) -> str:
    completions = await asyncio.wait_for(call, ANSWER_S)
    return completions[0].replica


def call(batcher: ReplicaBatcher) -> asyncio.Task:
    return asyncio.get_running_loop().create_task(batcher.generate([1, 2, 3], SamplingParams()))


async def until_taken(batcher: ReplicaBatcher) -> None:
    """Until the batcher's loop has taken the calls just made off the queue."""
    await asyncio.sleep(0.1)  # the calls' tasks put them on the queue
    for _ in range(200):
        if batcher.queue.empty():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the batcher did not take the call")


def test_a_call_waiting_for_a_busy_replica_is_served_by_the_replicas_attached_next(replicas):
    """Every replica busy: the batcher's loop holds the next call until one is free. A re-attach (a
    restart) cancelled that loop and the call with it, so its caller waited for ever."""
    old, new = replicas

    async def scenario() -> None:
        batcher = ReplicaBatcher(window_ms=0)
        await batcher.attach([old], 0)
        ray.get(old.hold.remote(True), timeout=30)
        first = call(batcher)  # busy on the old replica
        await until_taken(batcher)
        second = call(batcher)  # taken by the loop, waiting for a free replica
        await until_taken(batcher)
        await batcher.attach([new], 0)
        assert await served_by(batcher, second) == "new"
        ray.get(old.hold.remote(False), timeout=30)
        assert await served_by(batcher, first) == "old"

    asyncio.run(scenario())


def test_a_replica_of_an_earlier_attempt_does_not_serve_after_a_re_attach(replicas):
    """A call in flight on the old replica when the batcher is re-attached: when it ends, that replica
    went back into the new attempt's free replicas and took a share of later calls (a dead one: a 503
    for every call it drew)."""
    old, new = replicas

    async def scenario() -> None:
        batcher = ReplicaBatcher(window_ms=0)
        await batcher.attach([old], 0)
        ray.get(old.hold.remote(True), timeout=30)
        in_flight = call(batcher)
        await until_taken(batcher)
        await asyncio.sleep(0.5)
        await batcher.attach([new], 0)
        ray.get(old.hold.remote(False), timeout=30)
        assert await served_by(batcher, in_flight) == "old"
        later = [await served_by(batcher, call(batcher)) for _ in range(4)]
        assert later == ["new"] * 4

    asyncio.run(scenario())


def test_a_replica_answer_the_batcher_cannot_read_is_a_503_naming_it_and_the_replica_serves_on(replicas):
    """A replica answering something other than completions: the batcher failed outside its error
    handling, so the call's caller waited for ever and the replica never went back to the free ones."""
    only = replicas[0]

    async def scenario() -> None:
        batcher = ReplicaBatcher(window_ms=0)
        await batcher.attach([only], 0)
        ray.get(only.hold.remote(False, garbled=True), timeout=30)
        with pytest.raises(TrajectoryError) as caught:
            await asyncio.wait_for(call(batcher), ANSWER_S)
        assert caught.value.status == 503 and caught.value.code == "rollout_failed"
        assert "NoneType" in str(caught.value), str(caught.value)
        ray.get(only.hold.remote(False), timeout=30)
        assert await served_by(batcher, call(batcher)) == "old"

    asyncio.run(scenario())


def test_a_batch_in_flight_across_a_re_attach_runs_no_further_group_on_the_old_replica(replicas):
    """A batch of two sampling settings runs as two generate calls, one after the other. Re-attached
    between them (new replicas a version ahead), the second ran on the old replica anyway, its
    completions stamped with the new attempt's version."""
    old, new = replicas

    async def scenario() -> None:
        batcher = ReplicaBatcher(window_ms=0)
        await batcher.attach([old], 0)
        ray.get(old.hold.remote(True), timeout=30)
        loop = asyncio.get_running_loop()
        calls = [loop.create_task(batcher.generate([1], SamplingParams(temperature=t))) for t in (0.5, 1.0)]
        await until_taken(batcher)  # one batch, its first setting held on the old replica
        await batcher.attach([new], 5)  # the replica answers version 0: the new attempt's offset is 5
        ray.get(old.hold.remote(False), timeout=30)
        done = await asyncio.wait_for(asyncio.gather(*calls, return_exceptions=True), ANSWER_S)
        served = [d for d in done if not isinstance(d, BaseException)]
        assert [(c[0].replica, c[0].weight_version) for c in served] == [("old", 0)], done
        (refused,) = [d for d in done if isinstance(d, TrajectoryError)]
        assert refused.status == 503 and "started again" in str(refused), str(refused)

    asyncio.run(scenario())
