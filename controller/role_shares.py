"""Each role's CPUs and GPUs per worker, where the spec leaves them to the defaults.

A job's roles are its training workers and, on placement 'split', its rollout workers. Their default
CPU sizes divide one budget among all of them: the largest node's CPUs, at most the physical cores
(a rank never runs more torch threads than cores, engines/threads.py), less what sizes given
explicitly take. Each default worker gets whole CPUs when there are enough to give every one at least
one, else an equal fraction, but never less than a quarter CPU. So a job whose sizes are all
defaults fits the node it is sized from unless it asks for more than four workers a core; a size the user gives is kept as given, and the
service refuses it when the cluster cannot hold it (Service.check_fits_cluster).

GPUs: a worker left to the default takes one whole GPU when the cluster has any, none otherwise (two
ranks of one group cannot share a device under NCCL); a job whose default workers outnumber the
cluster's GPUs is refused with a hint to give fractions. Torch-free and Ray-free: the caller says
what the cluster has (controller/resource_pool.py `cluster_capacity`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from schema.resources import ResourcesSpec, WorkerResources

MIN_CPUS = 0.01  # Ray's resolution, and resources.cpus_per_worker's least value
# The least a worker left to the default gets: each is a process holding torch and a model, so a job of
# more default workers than four a core is refused as too big for the node rather than packed in.
MIN_DEFAULT_CPUS = 0.25


@dataclass(frozen=True)
class Capacity:
    """What default sizes are cut from: the CPUs a job may take on one node, and the cluster's GPUs."""

    cpus: float
    gpus: float


@dataclass(frozen=True)
class Share:
    """One role's workers and what each holds."""

    workers: int
    cpus: float
    gpus: float


def role_shares(resources: ResourcesSpec, capacity: Capacity) -> dict[str, Share]:
    """{"training": ..., "rollout": ...} (rollout on placement 'split' only), per-worker sizes filled in."""
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
    """The CPUs of each worker left to the default: what the explicit sizes leave of `budget`, divided
    over those workers; when they leave nothing, an even split of the whole budget over every worker
    (the explicit sizes are then what the cluster refuses)."""
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
