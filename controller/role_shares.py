"""Each role's CPUs and GPUs per worker, where the spec leaves them to the defaults.

Default CPU sizes divide one budget (the largest node's CPUs, at most its physical cores) among the
default workers of every role, less what explicit sizes take: whole CPUs when every worker gets one,
else an equal fraction of at least MIN_DEFAULT_CPUS. A default worker takes one whole GPU when the
cluster has any (NCCL ranks cannot share a device). Torch-free and Ray-free: the caller says what the
cluster has.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from schema.resources import ResourcesSpec, WorkerResources

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
