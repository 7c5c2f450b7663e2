"""How many CPU threads a rank's torch should use.

Ray gives an actor OMP_NUM_THREADS = its CPU request, so without this a rank computes on one core.
A rank uses its bundle's CPUs, capped by its share of the node's physical cores (hyper-threads only
contend). A small model computes on one thread: waking a second costs more than it computes.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path

_TOPOLOGY = Path("/sys/devices/system/cpu")


def _allowed_cpus() -> list[int]:
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def physical_cores() -> int:
    """Distinct physical cores among the CPUs this process may run on (unreadable topology: one per CPU)."""
    cores = set()
    for cpu in _allowed_cpus():
        topology = _TOPOLOGY / f"cpu{cpu}" / "topology"
        try:
            cores.add(((topology / "physical_package_id").read_text(), (topology / "core_id").read_text()))
        except OSError:
            cores.add(("cpu", str(cpu)))
    return max(1, len(cores))


def logical_cpus() -> int:
    return len(_allowed_cpus())


def set_torch_threads(bundle_cpus: float, ranks_on_node: int = 1) -> int:
    """Set torch's intra-op thread count for this rank (its bundle's CPUs, capped by its share of the
    node's physical cores); returns it."""
    threads = max(1, min(int(bundle_cpus), physical_cores() // max(1, ranks_on_node)))
    import torch  # here, not at the top: the service reads physical_cores without torch

    torch.set_num_threads(threads)
    return threads


ONE_THREAD_BELOW_HIDDEN = 256  # models narrower than this compute on one thread


def hidden_size_of(model_path: str | Path) -> int | None:
    """The hidden size in an HF folder's config.json (a multimodal model's text_config), or None."""
    path = Path(model_path) / "config.json"
    if not path.exists():
        return None
    config = json.loads(path.read_text())
    return config.get("hidden_size") or config.get("text_config", {}).get("hidden_size")


def limit_threads_for_model(model_path: str | Path) -> int:
    """Lower torch's thread count to one for a model of hidden size below ONE_THREAD_BELOW_HIDDEN;
    returns the count."""
    import torch

    hidden = hidden_size_of(model_path)
    if hidden is not None and hidden < ONE_THREAD_BELOW_HIDDEN:
        torch.set_num_threads(1)
    return torch.get_num_threads()


# What a user may set for OpenMP's waiting threads; a rank keeps theirs.
OPENMP_WAIT_VARS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")


def openmp_wait_env(cores_shared: bool, inherited: Mapping[str, str]) -> dict[str, str]:
    """The OpenMP wait setting for a rank's environment: spinning threads are fastest on cores of its
    own, but on shared cores they take the time the working thread needs, so there they sleep. A
    user's own OMP_WAIT_POLICY or GOMP_SPINCOUNT is kept."""
    own = {name: inherited[name] for name in OPENMP_WAIT_VARS if name in inherited}
    if own:
        return own
    return {"OMP_WAIT_POLICY": "PASSIVE"} if cores_shared else {}
