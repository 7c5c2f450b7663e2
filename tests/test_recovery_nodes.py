"""A dead node (controller/recovery.py): two local Ray nodes, a job with a rank on each, and the
worker node's raylet killed while the job runs.

- SPREAD (best effort): after the loss the job's two ranks fit the surviving node, so the restart
  places both there at once and the job continues.
- STRICT_SPREAD (one rank per node): the job cannot fit one node; its restart waits, shown as
  `restarting (1/3): worker rank 1 died (waiting for resources)`, until a new node joins, then
  resumes from its checkpoint and finishes.

The cluster runs in a child process with its own Ray temp dir, as in tests/test_multinode.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[1]
WORKER_NODE_IP = "127.0.0.2"
NEW_NODE_IP = "127.0.0.3"


def job(strategy: str) -> dict[str, Any]:
    """Two ranks of one CPU; no backoff."""
    spec = {
        "method": "grpo",
        "model": {"builtin": "tiny-qwen2"},
        "reward": {"function": "tests.reward_fns:paced_digit_reward"},  # >= 0.4 s a step: time to act
        "trainer": {"total_steps": 6, "prompts_per_step": 4, "val_every": 0, "restart_wait_s": 120},
        "rollout": {"n": 4, "max_new_tokens": 4},
        "checkpoint": {"every": 1, "keep_last": 2, "export_hf": False},
        "resources": {"workers": 2, "cpus_per_worker": 1, "placement_strategy": strategy},
    }
    spec["trainer"]["restart_backoff_s"] = 0
    return spec


def run_job(cluster: Any, workdir: Path, strategy: str, add_node: bool) -> dict[str, Any]:
    """Start the job, kill the worker node after its first checkpoint, (add a node once the restart waits),
    and report what the job recorded and which restart phases it showed."""
    from controller import checkpoints
    from controller.sink import JsonlSink
    from controller.trainer import Trainer
    from schema.job import JobSpec

    worker_node = cluster.add_node(num_cpus=2, node_ip_address=WORKER_NODE_IP)
    cluster.wait_for_nodes()
    sink = JsonlSink(workdir)
    trainer = Trainer(JobSpec.model_validate(job(strategy)), workdir, sink, name=f"nodes-{strategy.lower()}")
    outcome: dict[str, Any] = {}

    def train() -> None:
        try:
            trainer.run()
            outcome["status"] = "succeeded"
        except Exception as err:
            outcome["status"], outcome["error"] = "failed", f"{type(err).__name__}: {err}"

    thread = threading.Thread(target=train)
    thread.start()
    deadline = time.time() + 240
    while not checkpoints.complete(workdir) and thread.is_alive() and time.time() < deadline:
        time.sleep(0.05)  # until step 1's checkpoint is committed
    cluster.remove_node(worker_node, allow_graceful=False)  # the raylet and its workers die
    phases: list[str] = []
    while thread.is_alive() and time.time() < deadline:
        status = trainer.recovery.status
        if status and (not phases or phases[-1] != status["phase"]):
            phases.append(status["phase"])
        if add_node and status and status["phase"] == "waiting for resources":
            time.sleep(3)  # it keeps waiting: nothing else frees a second node
            phases.append(trainer.recovery.status["phase"])
            cluster.add_node(num_cpus=2, node_ip_address=NEW_NODE_IP)
            add_node = False
        time.sleep(0.05)
    thread.join(timeout=60)
    return {
        **outcome,
        "phases": phases,
        "events": [{"kind": e["kind"], "message": e["message"], "data": e["data"]} for e in sink.events],
        "steps": [r["step"] for r in sink.history],
        "restarts": [r["values"]["job/restarts"] for r in sink.history],
    }


def run_scenario() -> dict[str, Any]:
    import ray
    from ray.cluster_utils import Cluster

    # Quick health checks: a dead raylet is noticed in ~3 s instead of ~30.
    system = {"health_check_period_ms": 500, "health_check_failure_threshold": 4}
    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 2, "include_dashboard": False, "_system_config": system},
    )
    report: dict[str, Any] = {}
    try:
        ray.init(
            address=cluster.address,
            namespace="tandem-recovery-nodes",
            logging_level="warning",
            runtime_env={"env_vars": {"PYTHONPATH": str(REPO), "TOKENIZERS_PARALLELISM": "false"}},
        )
        with tempfile.TemporaryDirectory() as tmp:
            report["spread"] = run_job(cluster, Path(tmp) / "spread", "SPREAD", add_node=False)
            report["strict"] = run_job(cluster, Path(tmp) / "strict", "STRICT_SPREAD", add_node=True)
    finally:
        ray.shutdown()
        cluster.shutdown()
    return report


@pytest.fixture(scope="module")
def report() -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="trn-", dir="/tmp") as tmp:  # short: Ray's socket paths
        out = Path(tmp) / "report.json"
        code = (
            "import json; from tests.test_recovery_nodes import run_scenario; "
            f"json.dump(run_scenario(), open({str(out)!r}, 'w'))"
        )
        env = {**os.environ, "RAY_TMPDIR": tmp, "PYTHONPATH": str(REPO), "TOKENIZERS_PARALLELISM": "false"}
        env.pop("RAY_ADDRESS", None)
        done = subprocess.run(
            [sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=900
        )
        tail = f"{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
        assert done.returncode == 0, f"two-node recovery scenario failed:\n{tail}"
        return json.loads(out.read_text())


def placements(events: list[dict]) -> list[set[str]]:
    """The node IPs of each start of the workers, in order."""
    return [set(e["data"]["node_ips"]) for e in events if e["kind"] == "placement"]


def restart_events(events: list[dict]) -> list[dict]:
    return [e for e in events if e["kind"] == "restart"]


@pytest.mark.slow
def test_a_spread_job_continues_on_the_surviving_node(report):
    spread = report["spread"]
    assert spread["status"] == "succeeded", spread.get("error")
    (restart,) = restart_events(spread["events"])
    assert restart["data"]["cause"] == "died"
    assert restart["message"].startswith("restarting (1/3): worker rank")
    first, second = placements(spread["events"])
    assert WORKER_NODE_IP in first and len(first) == 2  # a rank on each node
    assert WORKER_NODE_IP not in second and len(second) == 1  # both ranks on the head now
    assert spread["steps"] == list(range(1, 7))  # every step once, the re-run ones replaced
    assert spread["restarts"][-1] == 1.0


@pytest.mark.slow
def test_a_strict_spread_job_waits_for_a_node_then_resumes(report):
    strict = report["strict"]
    assert strict["status"] == "succeeded", strict.get("error")
    (restart,) = restart_events(strict["events"])
    resumed_from = restart["data"]["resume_step"]
    assert resumed_from >= 1  # the node died after the first checkpoint
    # It waited (and was still waiting 3 s later), then started the workers once the node joined.
    assert strict["phases"][:2] == ["waiting for resources", "waiting for resources"]
    assert "starting workers" in strict["phases"]
    first, second = placements(strict["events"])
    assert WORKER_NODE_IP in first and NEW_NODE_IP in second and WORKER_NODE_IP not in second
    assert "resumed" in [e["kind"] for e in strict["events"]]
    assert strict["steps"] == list(range(1, 7))
