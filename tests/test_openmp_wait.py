"""OpenMP's waiting threads in a rank (engines/threads.openmp_wait_env, controller/worker_group.py):
they spin between ops where the rank has its cores to itself, sleep (PASSIVE) where the cores are
shared, and a user's own setting is kept. libgomp reads the setting when torch loads, so the rank
on a Ray of its own runs in a fresh interpreter."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from engines.threads import OPENMP_WAIT_VARS, openmp_wait_env

ROOT = Path(__file__).resolve().parents[1]


def test_spin_on_own_cores_sleep_on_shared_ones_and_keep_the_users_setting():
    assert openmp_wait_env(cores_shared=False, inherited={}) == {}  # libgomp's default: spin a while
    assert openmp_wait_env(cores_shared=True, inherited={"PATH": "/bin"}) == {"OMP_WAIT_POLICY": "PASSIVE"}
    for shared in (False, True):
        assert openmp_wait_env(shared, {"OMP_WAIT_POLICY": "active"}) == {"OMP_WAIT_POLICY": "active"}
        # a spin count alone is the user's choice too: PASSIVE would override it
        assert openmp_wait_env(shared, {"GOMP_SPINCOUNT": "1000"}) == {"GOMP_SPINCOUNT": "1000"}


# On a Ray that advertises this machine's CPUs (as `tandem serve` starts one), what a rank started
# with its whole bundle (share 1) and with half of it finds in its environment. (The test suite's
# Ray advertises more CPUs than the machine has: tests/test_worker_group.py checks that case.)
PROGRAM = """
import json, sys
sys.path.insert(0, {root!r})
import ray
from controller.resource_pool import ResourcePool
from controller.worker_group import RayWorkerGroup
from engines.threads import logical_cpus
from tests.wait_worker import WaitWorker

ray.init(address="local", num_cpus=logical_cpus(), include_dashboard=False, logging_level="error")
pool = ResourcePool(bundles=1, cpus_per_bundle=1)
seen = {{}}
for share in (1.0, 0.5):
    group = RayWorkerGroup(pool, WaitWorker, group_name="wait", share=share, start_timeout_s=120)
    seen[str(share)] = group.wait_env()[0]
    group.shutdown()
print(json.dumps(seen))
"""


def test_ranks_spin_on_a_ray_of_the_machines_cpus_and_sleep_on_half_a_bundle():
    clean = {k: v for k, v in os.environ.items() if k not in (*OPENMP_WAIT_VARS, "RAY_ADDRESS")}
    out = subprocess.run(
        [sys.executable, "-c", PROGRAM.format(root=str(ROOT))],
        env=clean, capture_output=True, text=True, timeout=240, check=True,
    )  # fmt: skip
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen["1.0"] == {"OMP_WAIT_POLICY": None, "GOMP_SPINCOUNT": None}  # its own cores: spin
    assert seen["0.5"] == {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": None}  # another group's beside it
