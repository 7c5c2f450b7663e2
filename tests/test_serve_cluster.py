"""`tandem serve` joining a two-node Ray cluster made with `ray start`, driven over HTTP only.

The cluster is what an operator runs: a head (`ray start --head`) and a second node on 127.0.0.2
(`ray start --address`), 2 CPUs each, every port chosen free, Ray's files under a private temp dir
(RAY_TMPDIR), so the session-wide Ray of conftest and other developers' Rays never see it. Ray token
authentication is on with a token of the test's own: on a machine with ~/.ray/auth_token, `ray start
--head` turns it on by itself, and nodes and drivers that join must then set RAY_AUTH_MODE=token.

Each `ray start --block` is a child of the test, and SIGTERM to it stops that node's processes. The
test never runs `ray stop`: that stops every Ray process on the machine, not only this cluster's.
"""

from __future__ import annotations

import secrets
import shutil
import signal
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from controller.resource_pool import describe_placement
from tests.api_util import TERMINAL, tiny_job, wait_for
from tests.serve_util import (
    BIN,
    Served,
    cluster_env,
    free_ports,
    kill_leftovers,
    start_logged,
    stop,
    wait_until,
)

WORKER_NODE_IP = "127.0.0.2"  # two raylets on one machine: the second gets its own loopback address
NODE_PORT_FLAGS = (
    "--node-manager-port",
    "--object-manager-port",
    "--dashboard-agent-listen-port",
    "--dashboard-agent-grpc-port",
    "--metrics-export-port",
    "--runtime-env-agent-port",
)


def ray_start(*args: str) -> list[str]:
    """A `ray start` of one node that stays in the foreground (--block) until it is sent SIGTERM."""
    ports = [a for flag, port in zip(NODE_PORT_FLAGS, free_ports(6), strict=True) for a in (flag, str(port))]
    return [str(BIN / "ray"), "start", "--block", "--num-cpus", "2", "--num-gpus", "0",
            "--object-store-memory", str(200 * 2**20), "--disable-usage-stats", *ports, *args]  # fmt: skip


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    tmp = tempfile.mkdtemp(prefix="tsc-", dir="/tmp")  # short: Ray's socket paths have a length limit
    root, env = Path(tmp), cluster_env(tmp)
    gcs, client_port, dashboard_port, api_port = free_ports(4)
    address, url = f"127.0.0.1:{gcs}", f"http://127.0.0.1:{api_port}"
    token = "tdm_" + secrets.token_urlsafe(24)
    head_log, node_log, serve_log = root / "head.log", root / "node.log", root / "serve.log"
    processes: list[subprocess.Popen] = []
    try:
        head = ray_start("--head", "--port", str(gcs), "--temp-dir", f"{tmp}/ray", "--include-dashboard",
                         "false", "--dashboard-port", str(dashboard_port), "--ray-client-server-port",
                         str(client_port))  # fmt: skip
        processes.append(start_logged(head, env, head_log))

        def gcs_up() -> bool:  # the node and the service wait for the head's raylet themselves
            assert processes[0].poll() is None, f"the Ray head exited:\n{head_log.read_text()[-4000:]}"
            try:
                socket.create_connection(("127.0.0.1", gcs), timeout=1).close()
                return True
            except OSError:
                return False

        wait_until(gcs_up, "the Ray head's GCS did not open its port", 240, [head_log])
        node = ray_start("--address", address, "--node-ip-address", WORKER_NODE_IP)
        processes.append(start_logged(node, env, node_log))
        serve = [str(BIN / "tandem"), "serve", "--ray-address", address, "--port", str(api_port),
                 "--home", str(root / "home")]  # fmt: skip
        serving = start_logged(serve, {**env, "TANDEM_ADMIN_TOKEN": token}, serve_log)
        processes.append(serving)

        def ready() -> bool:
            assert serving.poll() is None, f"tandem serve exited:\n{serve_log.read_text()[-4000:]}"
            try:
                return httpx.get(url + "/readyz", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        wait_until(ready, "tandem serve was not ready", 240, [serve_log, node_log])
        yield Served(url, token, root / "home", serving, serve_log)
    finally:
        for process in reversed(processes):  # the service, then the second node, the head last
            stop(process, 30)
        kill_leftovers(tmp)
        shutil.rmtree(tmp, ignore_errors=True)


def test_describe_placement_names_each_nodes_ranks():
    assert describe_placement(["a", "a", "b"], ["10.0.0.1", "10.0.0.1", "10.0.0.2"]) == (
        "ranks 0-1 on 10.0.0.1, rank 2 on 10.0.0.2"
    )


def wait_for_both_nodes(served: Served, client: httpx.Client) -> None:
    def both_nodes() -> bool:
        return len([n for n in client.get("/v1/cluster").json()["nodes"] if n["alive"]]) == 2

    # A raylet's start on a loaded 2-core machine (make test's two workers) has taken over 60 s.
    wait_until(both_nodes, "the second node did not join", 180, [served.log])


def test_cluster_reports_both_nodes(served: Served):
    with served.client() as client:
        wait_for_both_nodes(served, client)
        cluster = client.get("/v1/cluster").json()
    assert [n["cpus"] for n in cluster["nodes"]] == [2, 2]
    assert WORKER_NODE_IP in {n["address"] for n in cluster["nodes"]}
    assert len({n["address"] for n in cluster["nodes"]}) == 2
    assert cluster["cpus"]["total"] == 4


def test_strict_spread_job_runs_its_ranks_on_both_nodes(served: Served):
    # STRICT_SPREAD, not SPREAD: Ray's SPREAD is best effort and once packed both ranks on the head under
    # make test's load (CI, stop 61), which is what it may do; STRICT_SPREAD is the placement that must hold.
    spec = tiny_job(
        reward={"function": "builtin:arithmetic"},
        trainer={"total_steps": 2},
        checkpoint={"every": 0},
        resources={"workers": 2, "placement_strategy": "STRICT_SPREAD"},
        metadata={"suite": "serve-cluster"},
    )
    with served.client() as client:
        wait_for_both_nodes(served, client)
        created = client.post("/v1/jobs", json=spec)
        assert created.status_code == 201, created.text
        job = wait_for(client, created.json()["id"], TERMINAL, timeout_s=150)
        logs = "\n".join(r["line"] for r in client.get(f"/v1/jobs/{job['id']}/logs?tail=40").json()["data"])
        assert job["status"] == "succeeded", f"{job['error']}\n{logs}\n{served.log_tail()}"
        events = client.get(f"/v1/jobs/{job['id']}/events", params={"limit": 1000}).json()["data"]
        nodes = {n["node_id"]: n["address"] for n in client.get("/v1/cluster").json()["nodes"]}
    placement = next(e for e in events if e["kind"] == "placement")
    assert sorted(placement["data"]["node_ids"]) == sorted(nodes)  # one rank on each node
    assert placement["data"]["node_ips"] == [nodes[n] for n in placement["data"]["node_ids"]]
    assert placement["data"]["strategy"] == "STRICT_SPREAD"
    assert "2 node(s)" in placement["message"]
    assert (served.home / "models" / "tiny-qwen2" / "config.json").exists()  # --home reached the job


def test_sigterm_stops_the_service_cleanly(served: Served):
    served.process.send_signal(signal.SIGTERM)
    assert served.process.wait(60) == 0, served.log_tail()
    assert "stopping" in served.log.read_text()
