"""The faults and the probe of bench/soak.py: which live process is which, killing one, and the API's
latency between kills.

A worker is found through the service's own Ray cluster: this file, run with `--list-actors` in a
child process (Ray's driver state stays out of the soak), connects to the cluster and prints every
live actor's class, pid and placement group. A job's training workers are `WorkerHost` actors in its
`<name>-pool` group, its rollout workers (placement split) those in `<name>-rollout-pool`, a Tinker
session host is a `WorkerHost` in a `session-host ...` placement group. A pid is killed only when it is a descendant of the soak's service
process and its title is Ray's (`ray::...`): nothing outside the soak is ever signalled.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

WORKER_KINDS = ("training", "rollout", "session_host")


def list_actors(address: str) -> None:
    """Print the cluster's live actors as JSON (run in a child process with the service's Ray env)."""
    import ray
    from ray._private.state import state
    from ray.core.generated import gcs_pb2

    ray.init(address=address, namespace="tandem", logging_level="error", log_to_driver=False)
    try:
        groups = {pg: info.get("name", "") for pg, info in ray.util.placement_group_table().items()}
        rows = []
        for raw in state._connect_and_get_accessor().get_actor_table(None, "ALIVE"):
            actor = gcs_pb2.ActorTableData.FromString(raw)
            group = groups.get(actor.placement_group_id.hex(), "")
            rows.append({"class": actor.class_name, "pid": actor.pid, "group": group})
        print(json.dumps(rows))
    finally:
        ray.shutdown()


def kind_of(actor: dict) -> str | None:
    if actor["class"] == "WorkerHost" and actor["group"].startswith("session-host"):
        return "session_host"
    if actor["class"] == "WorkerHost":
        return "rollout" if actor["group"].endswith("-rollout-pool") else "training"
    return None


def descendants(root: int) -> set[int]:
    """Every process under `root` (by parent pid), read from /proc."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(entry.name))
    found, todo = set(), [root]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def title(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def gcs_address(service_pid: int) -> str:
    """The address of the service's own cluster, read from its GCS process (Ray's `address="auto"`
    would take any cluster on the machine): the node IP from its arguments, the port from the file it
    writes into its session folder."""
    for pid in descendants(service_pid):
        args = title(pid).split()
        if not args or not args[0].endswith("gcs_server"):
            continue
        flags = dict(a[2:].split("=", 1) for a in args[1:] if a.startswith("--") and "=" in a)
        ports = list(Path(flags["session-dir"]).glob("gcs_server_port_*"))
        if ports:
            return f"{flags['node-ip-address']}:{ports[0].read_text().strip()}"
    raise RuntimeError(f"no GCS process (with its port written) under the service's pid {service_pid}")


def worker_targets(service_pid: int, env: dict[str, str], timeout_s: float = 90) -> dict[str, list[int]]:
    """The live workers of the service's cluster by kind (only Ray processes under the service)."""
    for attempt in (1, 2):  # a cluster that has just started may not take a driver yet
        command = [sys.executable, __file__, "--list-actors", gcs_address(service_pid)]
        found = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout_s)
        if found.returncode == 0:
            break
        if attempt == 2:
            last = found.stderr.strip().splitlines()[-1:] or ["(no output)"]
            raise RuntimeError(f"listing the cluster's actors failed: {last[0][:400]}")
        time.sleep(5)
    ours = descendants(service_pid)
    targets: dict[str, list[int]] = {kind: [] for kind in WORKER_KINDS}
    for actor in json.loads(found.stdout.strip().splitlines()[-1]):
        kind = kind_of(actor)
        if kind and actor["pid"] in ours and title(actor["pid"]).startswith("ray::"):
            targets[kind].append(actor["pid"])
    return targets


def kill(pid: int) -> bool:
    try:
        os.kill(pid, signal.SIGKILL)
        return True
    except ProcessLookupError:
        return False


@dataclass
class Prober:
    """GETs /healthz and /v1/jobs once a second; latencies kept with their time, failures counted."""

    url: str
    token: str
    period_s: float = 1.0
    samples: list[tuple[float, float]] = field(default_factory=list)  # (time, seconds)
    failures: list[tuple[float, str]] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        headers = {"Authorization": f"Bearer {self.token}"}
        with httpx.Client(base_url=self.url, headers=headers, timeout=10) as client:
            while not self.stop.wait(self.period_s):
                for path in ("/healthz", "/v1/jobs?limit=20"):
                    started = time.time()
                    try:
                        status = client.get(path).status_code
                    except httpx.HTTPError as err:
                        self.failures.append((started, f"{path}: {type(err).__name__}"))
                        continue
                    if status == 200:
                        self.samples.append((started, time.time() - started))
                    else:
                        self.failures.append((started, f"{path}: HTTP {status}"))

    def between(self, outages: list[tuple[float, float]]) -> tuple[list[float], list[str]]:
        """Latencies and failures outside the outage windows (a service kill until it is back, plus)."""

        def out(t: float) -> bool:
            return not any(lo <= t <= hi for lo, hi in outages)

        return [s for t, s in self.samples if out(t)], [f for t, f in self.failures if out(t)]


if __name__ == "__main__" and sys.argv[1:2] == ["--list-actors"]:
    list_actors(sys.argv[2])
