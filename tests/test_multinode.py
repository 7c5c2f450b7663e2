"""Worker groups across two Ray nodes: SPREAD placement, rank order by node, MASTER_ADDR from rank 0.

The two nodes are a `ray.cluster_utils.Cluster` on this machine: the head on the machine's own
address and a worker node on 127.0.0.2, each with 2 CPUs, so the nodes differ by node id and by IP.
It runs in a child process with its own Ray temp dir (RAY_TMPDIR): the session's local Ray from
conftest, and other developers' Ray instances on the same machine, never see it, and `ray.init()`
elsewhere cannot attach to it through /tmp/ray/ray_current_cluster.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch

from controller.resource_pool import rank_order
from workers.base import Dispatch, Worker, register
from workers.batch import Batch

REPO = Path(__file__).resolve().parents[1]
WORKER_NODE_IP = "127.0.0.2"


class NodeWorker(Worker):
    """Reports where it runs; its MESH call tags every row with its rank and node."""

    def __init__(self) -> None:
        super().__init__()
        self.register_mesh("dp", dp_rank=self.rank, is_collect=True)

    @register(Dispatch.MESH, mesh="dp")
    def tag_rows(self, batch: Batch) -> Batch:
        import ray

        n = len(batch)
        node = ray.get_runtime_context().get_node_id()
        return Batch.from_dict(
            tensors={"row": batch.tensors["row"], "rank": torch.full((n,), self.rank)},
            non_tensors={"node": [node] * n},
        )

    @register(Dispatch.ONE_TO_ALL)
    def where(self) -> dict[str, Any]:
        import ray

        env = {k: os.environ[k] for k in ("RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR")}
        return {"node": ray.get_runtime_context().get_node_id(), "ip": ray.util.get_node_ip_address(), **env}

    @register(Dispatch.ONE_TO_ALL)
    def all_reduce_rank(self) -> float:
        """A gloo all-reduce over the group's MASTER_ADDR / MASTER_PORT: the sum of the ranks."""
        import torch.distributed as dist

        dist.init_process_group("gloo", rank=self.rank, world_size=self.world_size)
        value = torch.tensor([float(self.rank)])
        dist.all_reduce(value)
        dist.destroy_process_group()
        return value.item()


def run_scenario() -> dict[str, Any]:
    """In the child: build the two-node cluster, place pools and a worker group, report what happened."""
    import ray
    from ray.cluster_utils import Cluster

    from controller.resource_pool import ResourcePool, ResourcePoolError
    from controller.worker_group import RayWorkerGroup
    from schema.resources import ResourcesSpec

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "include_dashboard": False})
    cluster.add_node(num_cpus=2, node_ip_address=WORKER_NODE_IP)
    report: dict[str, Any] = {}
    try:
        ray.init(
            address=cluster.address,
            namespace="tandem-multinode",
            logging_level="warning",
            runtime_env={"env_vars": {"PYTHONPATH": str(REPO)}},
        )
        report["node_ips"] = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]}
        spread = ResourcesSpec(workers=2, cpus_per_worker=1, placement_strategy="SPREAD")

        placements = []
        for attempt in range(2):  # the same rank -> node mapping each time the pool is rebuilt
            pool = ResourcePool.for_resources(spread, name=f"spread-{attempt}", ready_timeout_s=60)
            placements.append({"nodes": pool.node_of_rank(), "ips": pool.node_ip_of_rank()})
            if attempt == 0:
                pool.remove()
        report["placements"] = placements

        group = RayWorkerGroup(pool, NodeWorker, group_name="two-nodes")
        report["where"] = group.where()
        out = group.tag_rows(Batch.from_dict(tensors={"row": torch.arange(5)}))
        report["mesh"] = {
            "rows": out.tensors["row"].tolist(),
            "ranks": out.tensors["rank"].tolist(),
            "nodes": out.non_tensors["node"].tolist(),
        }
        report["all_reduce"] = group.all_reduce_rank()
        group.shutdown()
        pool.remove()

        packed = ResourcePool(2, cpus_per_bundle=1, strategy="STRICT_PACK", name="packed", ready_timeout_s=60)
        report["strict_pack_nodes"] = packed.node_of_rank()
        packed.remove()
        try:  # three bundles, one per node, on two nodes: never schedulable
            ResourcePool(3, cpus_per_bundle=0.5, strategy="STRICT_SPREAD", ready_timeout_s=3)
            report["strict_spread_error"] = None
        except ResourcePoolError as err:
            report["strict_spread_error"] = str(err)
    finally:
        ray.shutdown()
        cluster.shutdown()
    return report


@pytest.fixture(scope="module")
def report() -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="tmn-", dir="/tmp") as tmp:  # short: Ray's socket paths
        out = Path(tmp) / "report.json"
        code = (
            "import json, sys; from tests.test_multinode import run_scenario; "
            f"json.dump(run_scenario(), open({str(out)!r}, 'w'))"
        )
        env = {**os.environ, "RAY_TMPDIR": tmp, "PYTHONPATH": str(REPO), "TOKENIZERS_PARALLELISM": "false"}
        env.pop("RAY_ADDRESS", None)
        done = subprocess.run(
            [sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=150
        )
        tail = f"{done.stdout[-3000:]}\n{done.stderr[-5000:]}"
        assert done.returncode == 0, f"multi-node scenario failed:\n{tail}"
        return json.loads(out.read_text())


def test_rank_order_groups_bundles_by_node_ip_then_node_id():
    # Bundles alternate between nodes; "b" and "c" share an IP; IPs compare as numbers.
    node_of_bundle = {0: "c", 1: "a", 2: "b", 3: "a", 4: "c", 5: "b"}
    ips = {"a": "10.0.0.10", "b": "10.0.0.9", "c": "10.0.0.9"}
    assert rank_order(node_of_bundle, ips) == [2, 5, 0, 4, 1, 3]


def test_spread_pool_lands_on_both_nodes_in_a_stable_rank_order(report):
    first, second = report["placements"]
    assert len(set(first["nodes"])) == 2
    assert set(first["nodes"]) == set(report["node_ips"])
    assert first == second
    assert first["ips"] == sorted(first["ips"], key=lambda ip: tuple(int(p) for p in ip.split(".")))


def test_mesh_call_runs_on_ranks_on_two_nodes(report):
    mesh, where = report["mesh"], report["where"]
    assert mesh["rows"] == [0, 1, 2, 3, 4]
    assert mesh["ranks"] == [0, 0, 0, 1, 1]  # padded to 6, 3 rows per dp rank, padding dropped
    node_of_rank = [w["node"] for w in where]
    assert mesh["nodes"] == [node_of_rank[r] for r in mesh["ranks"]]
    assert len(set(node_of_rank)) == 2
    assert node_of_rank == report["placements"][1]["nodes"]


def test_master_addr_is_rank_zero_node_and_rendezvous_works(report):
    where = report["where"]
    rank0_ip = report["node_ips"][where[0]["node"]]
    assert {w["MASTER_ADDR"] for w in where} == {rank0_ip}
    assert {w["ip"] for w in where} == set(report["node_ips"].values())  # one rank per node IP
    assert [(w["LOCAL_RANK"], w["LOCAL_WORLD_SIZE"]) for w in where] == [("0", "1"), ("0", "1")]
    assert report["all_reduce"] == [1.0, 1.0]  # 0 + 1 on both ranks


def test_strict_strategies_are_honoured(report):
    assert len(set(report["strict_pack_nodes"])) == 1
    error = report["strict_spread_error"]
    assert error is not None and "STRICT_SPREAD" in error
