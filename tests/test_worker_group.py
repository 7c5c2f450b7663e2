"""Worker groups on a real local Ray: mesh dispatch and collection, errors, dead actors, fused roles."""

from __future__ import annotations

import os
import re
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from controller.dispatch import MeshLayout
from controller.resource_pool import ResourcePool, cluster_capacity, job_shares
from controller.worker_group import RayWorkerGroup, WorkerGroupError, ready_all
from engines.host_memory import transparent_huge_pages
from engines.threads import logical_cpus, physical_cores
from schema.resources import ResourcesSpec
from tests.wait_worker import WaitWorker
from workers.base import Dispatch, Worker, register
from workers.batch import Batch
from workers.remote import wait_all


class MeshWorker(Worker):
    """Registers two meshes from per-rank tables, records what each MESH call received."""

    def __init__(self, layouts: dict[str, list[tuple[int, bool]]]) -> None:
        super().__init__()
        for name, table in layouts.items():
            dp, collect = table[self.rank]
            self.register_mesh(name, dp, collect)
        self.received: dict[str, list[int]] = {}

    def _echo(self, mesh: str, batch: Batch) -> Batch:
        rows = batch.tensors["row"].tolist()
        self.received[mesh] = rows
        n = len(batch)
        return Batch.from_dict(
            tensors={
                "row": batch.tensors["row"],
                "doubled": batch.tensors["row"] * 2,
                "rank": torch.full((n,), self.rank),
            },
            non_tensors={"text": [f"{t}!" for t in batch.non_tensors["text"]]},
        )

    @register(Dispatch.MESH, mesh="train")
    def train_step(self, batch: Batch) -> Batch:
        return self._echo("train", batch)

    @register(Dispatch.MESH, mesh="infer")
    def infer_step(self, batch: Batch, scale: int = 1) -> Batch:
        out = self._echo("infer", batch)
        out.tensors["doubled"] = out.tensors["doubled"] * scale
        return out

    @register(Dispatch.ONE_TO_ALL)
    def get_received(self) -> dict[str, list[int]]:
        return self.received

    @register(Dispatch.ALL_TO_ALL)
    def add(self, value: int) -> int:
        return value + self.rank

    @register(Dispatch.RANK_ZERO)
    def who(self) -> tuple[int, int]:
        return self.rank, self.world_size

    @register(Dispatch.ONE_TO_ALL)
    def fail_on(self, bad_rank: int) -> int:
        if self.rank == bad_rank:
            raise ValueError(f"rank {self.rank} refuses")
        return self.rank

    @register(Dispatch.ONE_TO_ALL)
    def sleep(self, seconds: float) -> int:
        time.sleep(seconds)
        return self.rank

    @register(Dispatch.ONE_TO_ALL)
    def env(self) -> dict[str, str]:
        return {k: os.environ[k] for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}

    @register(Dispatch.ONE_TO_ALL)
    def huge_pages_mib(self, mib: int) -> dict[str, Any]:
        """GLIBC_TUNABLES, and this process's anonymous huge pages while a fresh `mib` MiB tensor lives."""
        block = torch.ones(mib << 18)  # float32: 4 bytes each
        with open("/proc/self/smaps_rollup") as f:
            kib = next(int(line.split()[1]) for line in f if line.startswith("AnonHugePages:"))
        del block
        return {"tunables": os.environ.get("GLIBC_TUNABLES", ""), "huge_mib": kib >> 10}


def make_batch(n: int) -> Batch:
    return Batch.from_dict(
        tensors={"row": torch.arange(n)}, non_tensors={"text": [f"r{i}" for i in range(n)]}
    )


# "train": dp=2 x tp=2 (ranks 0,1 -> dp 0; 2,3 -> dp 1; tp rank 0 collects); "infer": dp=4.
IN_ORDER = {
    "train": [(0, True), (0, False), (1, True), (1, False)],
    "infer": [(0, True), (1, True), (2, True), (3, True)],
}
# The same shapes with dp ranks in an order unlike the global rank order, and tp rank 1 collecting.
SHUFFLED = {
    "train": [(1, False), (1, True), (0, False), (0, True)],
    "infer": [(2, True), (0, True), (3, True), (1, True)],
}


@pytest.fixture(scope="module")
def pool(ray_cluster):
    pool = ResourcePool(bundles=4, cpus_per_bundle=1.0)
    yield pool
    pool.remove()


def expected_rows(n: int, dp_size: int) -> list[list[int]]:
    """Rows each dp rank receives after padding with leading rows up to a multiple of dp_size."""
    padded = list(range(n)) + list(range((-n) % dp_size))
    size = len(padded) // dp_size
    return [padded[d * size : (d + 1) * size] for d in range(dp_size)]


@pytest.fixture(scope="module")
def groups(pool):
    """One 4-rank group per layout table, shared by the tests of this module."""
    made = ready_all(
        {
            "in-order": RayWorkerGroup.launch(pool, MeshWorker, IN_ORDER, group_name="in-order", share=0.25),
            "shuffled": RayWorkerGroup.launch(pool, MeshWorker, SHUFFLED, group_name="shuffled", share=0.25),
        }
    )
    yield made
    for group in made.values():
        group.shutdown()


@pytest.mark.parametrize("name,layouts", [("in-order", IN_ORDER), ("shuffled", SHUFFLED)])
def test_mesh_dispatch_routes_rows_and_collects_by_dp_rank(groups, name, layouts):
    group = groups[name]
    for n in (8, 7, 5):
        batch = make_batch(n)
        for mesh, method in (("train", group.train_step), ("infer", group.infer_step)):
            out = method(batch)
            table = layouts[mesh]
            dp_size = len({dp for dp, _ in table})
            # Output order equals input order, padding removed, nothing lost or duplicated.
            assert out.tensors["row"].tolist() == list(range(n))
            assert out.tensors["doubled"].tolist() == [2 * i for i in range(n)]
            assert out.non_tensors["text"].tolist() == [f"r{i}!" for i in range(n)]
            # Only collect ranks are gathered: each row came from the collect rank of its dp shard.
            rows_of_dp = expected_rows(n, dp_size)
            collector = {dp: r for r, (dp, c) in enumerate(table) if c}
            expected_rank = [collector[dp] for dp in range(dp_size) for _ in rows_of_dp[dp]][:n]
            assert out.tensors["rank"].tolist() == expected_rank, (mesh, n)
        received = group.get_received()
        for mesh in ("train", "infer"):
            table = layouts[mesh]
            rows_of_dp = expected_rows(n, len({dp for dp, _ in table}))
            for rank, (dp, _) in enumerate(table):
                assert received[rank][mesh] == rows_of_dp[dp], (mesh, rank, n)
        # tp peers (same dp rank in "train") received identical inputs.
        peers: dict[int, list[int]] = {}
        for rank, (dp, _) in enumerate(layouts["train"]):
            peers.setdefault(dp, []).append(rank)
        for ranks in peers.values():
            assert received[ranks[0]]["train"] == received[ranks[1]]["train"]
    assert group.mesh_layout("train").dp_size == 2 and group.mesh_layout("infer").dp_size == 4


def test_other_dispatch_modes_and_env(groups):
    group = groups["in-order"]
    assert group.add([10, 20, 30, 40]) == [10, 21, 32, 43]
    assert group.who() == (0, 4)
    out = group.infer_step(make_batch(4), scale=3)  # extra args reach every rank
    assert out.tensors["doubled"].tolist() == [0, 6, 12, 18]
    envs = group.env()
    assert [e["RANK"] for e in envs] == ["0", "1", "2", "3"]
    assert {e["WORLD_SIZE"] for e in envs} == {"4"}
    assert len({(e["MASTER_ADDR"], e["MASTER_PORT"]) for e in envs}) == 1
    with pytest.raises(ValueError, match="list of 4 values"):
        group.add([1, 2])
    with pytest.raises(TypeError, match="takes a Batch"):
        group.train_step({"row": [1]})


@pytest.mark.skipif(transparent_huge_pages() in (None, "never"), reason="no transparent huge pages")
def test_ranks_allocate_on_transparent_huge_pages(groups):
    """The rank's environment asks glibc's malloc for huge pages (engines/host_memory.py): a 256 MiB
    tensor is backed by them (4 KiB pages report 0 here in the kernel's 'madvise' mode)."""
    for report in groups["in-order"].huge_pages_mib(256):
        assert "glibc.malloc.hugetlb=1" in report["tunables"].split(":")
        assert report["huge_mib"] >= 200, report


def test_a_submitted_call_runs_while_the_controller_works_and_collects_alike(groups):
    group = groups["in-order"]
    start = time.monotonic()
    pending = group.submit("sleep", 0.5)
    submitted = time.monotonic() - start
    assert submitted < 0.4  # submit returned before the ranks finished sleeping
    assert pending.result() == [0, 1, 2, 3]  # collected as the blocking call collects
    out = group.submit("infer_step", make_batch(4), scale=3).result()
    assert out.tensors["doubled"].tolist() == [0, 6, 12, 18]
    with pytest.raises(WorkerGroupError, match=r"rank 1, method 'fail_on'"):
        group.submit("fail_on", 1).result()
    with pytest.raises(AttributeError, match="registers no method 'nope'"):
        group.submit("nope")


def test_exception_on_one_rank_names_the_rank_and_method(groups):
    group = groups["shuffled"]
    with pytest.raises(
        WorkerGroupError, match=r"worker group 'shuffled', rank 2, method 'fail_on'.*ValueError"
    ):
        group.fail_on(2)
    assert group.fail_on(-1) == [0, 1, 2, 3]  # the group still serves after a rank raised


def test_no_call_waits_past_its_timeout(groups):
    group = groups["shuffled"]
    group.call_timeout_s = 1.0
    try:
        start = time.monotonic()
        named = r"rank 0, method 'sleep': did not answer within 1s \(pid \d+ on .*\(ranks \[0, 1, 2, 3\] are silent"
        with pytest.raises(WorkerGroupError, match=named):
            group.sleep(3)
        assert time.monotonic() - start < 3
    finally:
        group.call_timeout_s = 60.0
    assert group.sleep(0) == [0, 1, 2, 3]  # the late calls drain; the group is usable again


def _wait_until_dead(ray_module, actor, timeout_s: float = 30.0) -> None:
    """ray.kill goes through the GCS while calls go straight to the actor, so a call made at once can
    still be served (CI saw it). Wait until Ray itself reports the actor dead."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            ray_module.get(actor.__ray_ready__.remote(), timeout=5)
        except ray_module.exceptions.RayActorError:
            return
        time.sleep(0.05)
    raise AssertionError(f"the killed actor still answered after {timeout_s}s")


def test_dead_actor_fails_the_next_call_quickly(pool, ray_cluster):
    """Named by its group, rank, pid and node: from a call on the group, and from one on that worker
    alone (an async lane's call on its own rollout worker)."""
    group = RayWorkerGroup(pool, MeshWorker, IN_ORDER, group_name="doomed", share=0.25)
    try:
        ray_cluster.kill(group.actors[1], no_restart=True)
        _wait_until_dead(ray_cluster, group.actors[1])
        start = time.monotonic()
        named = (
            rf"'doomed', rank 1, method 'get_received': the worker actor died \({re.escape(group.hosts[1])}\)"
        )
        with pytest.raises(WorkerGroupError, match=named):
            group.get_received()
        assert time.monotonic() - start < 30
        alone = group.actors[1].execute.remote("get_received", ((), {}))
        with pytest.raises(WorkerGroupError, match=named) as failed:
            wait_all(group.name, "get_received", [alone], 30, group.hosts, ranks=[1])
        assert (failed.value.group, failed.value.rank, failed.value.kind) == ("doomed", 1, "died")
    finally:
        group.shutdown()


class MeetingWorker(Worker):
    """Its start waits (up to 60 s) until the other group's start has begun: two groups started one
    after the other never meet, and the first fails. `fail=True` raises instead."""

    def __init__(self, folder: str, me: str, other: str, fail: bool = False) -> None:
        super().__init__()
        if fail:
            raise RuntimeError(f"{me} refuses to start")
        (Path(folder) / me).touch()
        deadline = time.monotonic() + 60
        while not (Path(folder) / other).exists():
            if time.monotonic() > deadline:
                raise TimeoutError(f"{me} started alone: {other} never began")
            time.sleep(0.05)
        self.pid = os.getpid()

    @register(Dispatch.ONE_TO_ALL)
    def get_pid(self) -> int:
        return self.pid


def test_launched_groups_start_side_by_side_and_a_failed_start_names_its_group(ray_cluster, tmp_path):
    """`start_groups` launches a job's groups (rollout and training, actor and critic) and waits for
    them together: each group's workers build while the other's do."""
    pools = [ResourcePool(bundles=1, cpus_per_bundle=0.5, name=f"meet-{i}") for i in range(2)]
    try:
        pending = {
            name: RayWorkerGroup.launch(pool, MeetingWorker, str(tmp_path), name, other, group_name=name)
            for pool, (name, other) in zip(pools, [("left", "right"), ("right", "left")], strict=True)
        }
        groups = ready_all(pending)
        pids = {name: group.get_pid()[0] for name, group in groups.items()}
        assert len(set(pids.values())) == 2, pids
        for group in groups.values():
            group.shutdown()

        (tmp_path / "late").mkdir()
        pending = {
            "fine": RayWorkerGroup.launch(pools[0], MeetingWorker, str(tmp_path / "late"), "fine", "fine"),
            "broken": RayWorkerGroup.launch(pools[1], MeetingWorker, str(tmp_path), "broken", "x", fail=True,
                                            group_name="broken"),
        }  # fmt: skip
        with pytest.raises(WorkerGroupError, match=r"'broken', rank 0, method '__init__'.*refuses to start"):
            ready_all(pending)
    finally:
        for pool in pools:
            pool.remove()


def test_mesh_layout_validation():
    with pytest.raises(ValueError, match="dp ranks must be 0..1"):
        MeshLayout.from_info("m", [(0, True), (2, True)])
    with pytest.raises(ValueError, match="dp rank 0 must have exactly one collect rank"):
        MeshLayout.from_info("m", [(0, True), (0, True)])
    layout = MeshLayout.from_info("m", [(1, True), (1, False), (0, False), (0, True)])
    assert layout.collect_ranks() == [3, 0] and layout.dp_size == 2


class ThreadsWorker(Worker):
    @register(Dispatch.ONE_TO_ALL)
    def threads(self) -> tuple[int, str | None]:
        return torch.get_num_threads(), os.environ.get("OMP_WAIT_POLICY")


def test_auto_cpus_take_the_cores_and_ranks_use_them_as_threads(ray_cluster):
    """The test Ray advertises 8 CPUs on fewer cores: a job without resources takes the cores, not
    the 8, and its rank runs that many torch threads (Ray alone would leave it one per CPU asked)."""
    cores = physical_cores()
    assert cluster_capacity().cpus == min(8, cores)
    assert job_shares(ResourcesSpec())["training"].cpus == min(8, cores)
    pool = ResourcePool.for_resources(ResourcesSpec())
    try:
        group = RayWorkerGroup(pool, ThreadsWorker, group_name="threads", share=0.5)
        # share 0.5 asks Ray for 1 CPU when cores = 2; idle OpenMP threads sleep rather than spin
        assert group.threads() == [(min(8, cores), "PASSIVE")]
        group.shutdown()
    finally:
        pool.remove()


def test_ranks_sleep_where_ray_advertises_more_cpus_than_the_machine_has(ray_cluster, monkeypatch):
    """The test Ray advertises 8 CPUs: on a machine with fewer, Ray places more busy processes than
    CPUs, so even a rank with its whole bundle sleeps between ops (PASSIVE); a user's own OpenMP
    setting in the controller's environment reaches the rank instead (tests/test_openmp_wait.py has
    the Ray of the machine's own CPUs)."""
    pool = ResourcePool(bundles=1, cpus_per_bundle=1)
    try:
        group = RayWorkerGroup(pool, WaitWorker, group_name="wait", share=1.0)
        passive = "PASSIVE" if logical_cpus() < 8 else None
        assert group.wait_env() == [{"OMP_WAIT_POLICY": passive, "GOMP_SPINCOUNT": None}]
        group.shutdown()
        monkeypatch.setenv("GOMP_SPINCOUNT", "5000")
        group = RayWorkerGroup(pool, WaitWorker, group_name="wait", share=1.0)
        assert group.wait_env() == [{"OMP_WAIT_POLICY": None, "GOMP_SPINCOUNT": "5000"}]
        group.shutdown()
    finally:
        pool.remove()
