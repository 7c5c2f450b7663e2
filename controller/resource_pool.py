"""A ResourcePool is a Ray placement group plus a stable rank order over its bundles, and each role's
share of the cluster (`role_shares`).

Worker groups are placements of one pool, each taking a `share` of every bundle, so groups can be
colocated. Ranks follow the bundles grouped by node, nodes ordered by (IP, node id): the same order
whenever the pool is rebuilt on the same cluster, and a node's ranks are neighbours (LOCAL_RANK).

Default CPU sizes divide one budget (the largest node's CPUs, at most its physical cores) among the
default workers of every role, less what explicit sizes take: whole CPUs when every worker gets one,
else an equal fraction of at least MIN_DEFAULT_CPUS. A default worker takes one whole GPU when the
cluster has any (NCCL ranks cannot share a device).
"""

from __future__ import annotations

import ipaddress
import math
from dataclasses import dataclass
from typing import Any

import ray
from ray.util.placement_group import (
    PlacementGroup,
    placement_group,
    placement_group_table,
    remove_placement_group,
)

from engines.threads import logical_cpus, physical_cores
from schema.resources import ResourcesSpec, WorkerResources

STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")
MIN_CPUS = 0.01  # Ray's resolution, and resources.cpus_per_worker's least value
# Each worker is a process holding torch and a model: more than four a core is refused, not packed in.
MIN_DEFAULT_CPUS = 0.25


@dataclass(frozen=True)
class Capacity:
    cpus: float
    gpus: float


@dataclass(frozen=True)
class Share:
    workers: int
    cpus: float
    gpus: float


def role_shares(resources: ResourcesSpec, capacity: Capacity) -> dict[str, Share]:
    """{"training": ..., "rollout": ...} (rollout on placement 'split' only), sizes filled in."""
    groups: dict[str, WorkerResources] = {"training": resources}
    if resources.rollout_workers is not None:
        groups["rollout"] = resources.rollout_workers
    default_cpus = _default_cpus(list(groups.values()), capacity.cpus)
    default_gpus = 1.0 if capacity.gpus >= 1 else 0.0
    return {
        role: Share(
            group.workers,
            float(group.cpus_per_worker) if group.cpus_per_worker is not None else default_cpus,
            float(group.gpus_per_worker) or default_gpus,
        )
        for role, group in groups.items()
    }


def _default_cpus(groups: list[WorkerResources], budget: float) -> float:
    """What the explicit sizes leave of `budget`, divided over the default workers; when they leave
    nothing, an even split over every worker (the cluster then refuses the explicit sizes)."""
    defaults = sum(g.workers for g in groups if g.cpus_per_worker is None)
    if defaults == 0:
        return 0.0
    left = budget - sum(g.workers * g.cpus_per_worker for g in groups if g.cpus_per_worker is not None)
    if left < MIN_CPUS * defaults:
        left = budget * defaults / sum(g.workers for g in groups)
    each = left / defaults
    if each >= 1:
        return float(math.floor(each))
    return max(MIN_DEFAULT_CPUS, round(math.floor(each / MIN_CPUS + 1e-9) * MIN_CPUS, 2))


class ResourcePoolError(RuntimeError):
    """The pool's placement group could not be created or scheduled."""


def _ip_sort_key(ip: str) -> tuple[int, int, str]:
    """Numeric order ("10.0.0.9" before "10.0.0.10", IPv4 before IPv6); not an IP: last."""
    try:
        address = ipaddress.ip_address(ip)
    except ValueError:
        return (1, 0, ip)
    return (0, (address.version << 128) | int(address), ip)


def rank_order(node_of_bundle: dict[int, str], ip_of_node: dict[str, str]) -> list[int]:
    """Bundle indices in rank order: by node IP, then node id (several raylets may share an IP), then
    bundle index."""

    def key(bundle: int) -> tuple[tuple[int, int, str], str, int]:
        node = node_of_bundle[bundle]
        return (_ip_sort_key(ip_of_node.get(node, "")), node, bundle)

    return sorted(node_of_bundle, key=key)


class ResourcePool:
    def __init__(
        self,
        bundles: int,
        cpus_per_bundle: float = 1.0,
        gpus_per_bundle: float | None = None,
        strategy: str = "PACK",
        name: str = "",
        ready_timeout_s: float = 120.0,
    ) -> None:
        if bundles <= 0:
            raise ValueError(f"a resource pool needs at least one bundle, got {bundles}")
        if strategy not in STRATEGIES:
            raise ValueError(f"unknown placement strategy '{strategy}'; use one of {STRATEGIES}")
        if gpus_per_bundle is None:
            # GPU bundles whenever the cluster has GPUs: the CPU path is for GPU-less clusters.
            gpus_per_bundle = 1.0 if ray.cluster_resources().get("GPU", 0) >= 1 else 0.0
        self.num_bundles = bundles
        self.cpus_per_bundle = float(cpus_per_bundle)
        self.gpus_per_bundle = float(gpus_per_bundle)
        self.strategy = strategy
        bundle = {"CPU": self.cpus_per_bundle}
        if self.gpus_per_bundle > 0:
            bundle["GPU"] = self.gpus_per_bundle
        self.placement_group: PlacementGroup = placement_group(
            [dict(bundle) for _ in range(bundles)], strategy=strategy, name=name
        )
        self._wait_ready(ready_timeout_s)
        self.bundle_order: list[int] = self._bundles_by_node()

    @classmethod
    def for_resources(
        cls, resources: ResourcesSpec, name: str = "", ready_timeout_s: float = 120.0, role: str = "training"
    ) -> ResourcePool:
        """The pool of one role ("training", or "rollout" on placement 'split') of a job's `resources`."""
        share = job_shares(resources)[role]
        strategy = resources.placement_strategy
        return cls(
            share.workers, share.cpus, share.gpus, strategy, name=name, ready_timeout_s=ready_timeout_s
        )

    def _wait_ready(self, timeout_s: float) -> None:
        try:
            ray.get(self.placement_group.ready(), timeout=timeout_s)
        except ray.exceptions.GetTimeoutError:
            remove_placement_group(self.placement_group)
            raise ResourcePoolError(
                f"placement group of {self.num_bundles} bundles x (CPU {self.cpus_per_bundle}, "
                f"GPU {self.gpus_per_bundle}) with strategy {self.strategy} could not be scheduled within "
                f"{timeout_s:.0f}s; the cluster has {ray.available_resources()} available"
            ) from None

    def _bundles_by_node(self) -> list[int]:
        table = placement_group_table(self.placement_group)
        return rank_order(table["bundles_to_node_id"], _node_ips())

    def node_of_rank(self) -> list[str]:
        table = placement_group_table(self.placement_group)
        return [table["bundles_to_node_id"][b] for b in self.bundle_order]

    def placement(self) -> dict[str, list[str]]:
        """Where each rank runs, in rank order: {"node_ids": [...], "node_ips": [...]}."""
        nodes, ips = self.node_of_rank(), _node_ips()
        return {"node_ids": nodes, "node_ips": [ips.get(node, "") for node in nodes]}

    def local_ranks(self) -> list[tuple[int, int]]:
        """(LOCAL_RANK, LOCAL_WORLD_SIZE) of each rank: its place among the ranks on its node."""
        nodes = self.node_of_rank()
        return [(nodes[:rank].count(node), nodes.count(node)) for rank, node in enumerate(nodes)]

    def remove(self) -> None:
        remove_placement_group(self.placement_group)


def cluster_capacity() -> Capacity:
    """What default sizes are cut from: the largest node's CPUs capped by this machine's physical cores
    (a Ray advertising more CPUs still runs several jobs side by side), and the cluster's GPUs."""
    cpus = float(max(1, min(int(largest_node_cpus()), physical_cores())))
    return Capacity(cpus, float(ray.cluster_resources().get("GPU", 0.0)))


def job_shares(resources: ResourcesSpec) -> dict[str, Share]:
    return role_shares(resources, cluster_capacity())


def largest_node_cpus() -> float:
    return max((n["Resources"].get("CPU", 0.0) for n in ray.nodes() if n.get("Alive")), default=1.0)


def cores_shared(share: float) -> bool:
    """Whether a rank's cores may be busy with other work: its group takes a share of its bundle, or
    Ray advertises more CPUs than this machine has."""
    return share < 1 or largest_node_cpus() > logical_cpus()


def job_needs(spec: dict[str, Any]) -> tuple[float, float, list[dict[str, float]]]:
    """(CPUs, GPUs, bundles) a job holds while it runs on this cluster: a bundle per worker of each role."""
    bundles: list[dict[str, float]] = []
    for share in job_shares(ResourcesSpec.model_validate(spec["resources"])).values():
        bundle = {"CPU": share.cpus, **({"GPU": share.gpus} if share.gpus else {})}
        bundles += [bundle] * share.workers
    return sum(b["CPU"] for b in bundles), sum(b.get("GPU", 0.0) for b in bundles), bundles


def describe_placement(node_ids: list[str], node_ips: list[str]) -> str:
    """'ranks 0-1 on 10.0.0.1, rank 2 on 10.0.0.2' (a node's ranks are contiguous)."""
    parts, first = [], 0
    for rank in range(1, len(node_ids) + 1):
        if rank == len(node_ids) or node_ids[rank] != node_ids[first]:
            ranks = f"rank {first}" if rank - 1 == first else f"ranks {first}-{rank - 1}"
            parts.append(f"{ranks} on {node_ips[first] or node_ids[first][:8]}")
            first = rank
    return ", ".join(parts)


def _node_ips() -> dict[str, str]:
    return {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()}
