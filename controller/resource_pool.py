"""A ResourcePool is a Ray placement group plus a stable rank order over its bundles.

Worker groups are placements of one pool: each group starts one actor per bundle and takes a
fraction (`share`) of the bundle's CPUs and GPUs, so several groups can be colocated on the same
bundles. Ranks follow the bundles ordered by node (node IP, then bundle index), so a job's ranks land
on the same nodes in the same order every time the pool is rebuilt on the same cluster.
"""

from __future__ import annotations

import ray
from ray.util.placement_group import (
    PlacementGroup,
    placement_group,
    placement_group_table,
    remove_placement_group,
)

STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")


class ResourcePoolError(RuntimeError):
    """The pool's placement group could not be created or scheduled."""


class ResourcePool:
    """`bundles` bundles of `cpus_per_bundle` CPUs (and GPUs when the cluster has them)."""

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

    @property
    def use_gpu(self) -> bool:
        return self.gpus_per_bundle > 0

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
        """Bundle indices sorted by (node IP, bundle index): the rank order."""
        table = placement_group_table(self.placement_group)
        node_of_bundle: dict[int, str] = table["bundles_to_node_id"]
        ip_of_node = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()}
        return sorted(node_of_bundle, key=lambda b: (ip_of_node.get(node_of_bundle[b], ""), b))

    def node_of_rank(self) -> list[str]:
        """Node id of each rank's bundle, in rank order."""
        table = placement_group_table(self.placement_group)
        return [table["bundles_to_node_id"][b] for b in self.bundle_order]

    def remove(self) -> None:
        remove_placement_group(self.placement_group)
