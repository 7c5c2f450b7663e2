"""How many CPU threads a rank's torch should use.

Ray gives an actor OMP_NUM_THREADS = its CPU request (1 for `num_cpus=1`), so without a decision
here a rank computes on one core whatever its bundle holds. A rank uses the CPUs of its bundle, but
never more threads than the physical cores it can share with the other ranks of its node: on a
node that advertises more logical CPUs than it has cores (hyper-threads, or a Ray started with
num_cpus above the core count), extra OpenMP threads only contend for the same cores.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

_TOPOLOGY = Path("/sys/devices/system/cpu")


def physical_cores() -> int:
    """Distinct physical cores among the CPUs this process may run on (its affinity).

    Read from Linux's CPU topology (one core per (package, core id)); where that is not readable,
    every allowed logical CPU counts as a core.
    """
    allowed = (
        sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else range(os.cpu_count() or 1)
    )
    cores = set()
    for cpu in allowed:
        topology = _TOPOLOGY / f"cpu{cpu}" / "topology"
        try:
            cores.add(((topology / "physical_package_id").read_text(), (topology / "core_id").read_text()))
        except OSError:
            cores.add(("cpu", str(cpu)))
    return max(1, len(cores))


def threads_for_rank(bundle_cpus: float, ranks_on_node: int = 1) -> int:
    """Threads for one rank: its bundle's CPUs, capped by its share of the node's physical cores."""
    share = physical_cores() // max(1, ranks_on_node)
    return max(1, min(int(bundle_cpus), share))


def set_torch_threads(bundle_cpus: float, ranks_on_node: int = 1) -> int:
    """Set torch's intra-op thread count for this rank (see `threads_for_rank`); returns it."""
    threads = threads_for_rank(bundle_cpus, ranks_on_node)
    torch.set_num_threads(threads)
    return threads
