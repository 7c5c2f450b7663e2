"""Helpers for tests that run `tandem serve` (and `ray start`) as real processes, as an operator does."""

from __future__ import annotations

import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent  # the `ray` and `tandem` scripts of this environment


@dataclass
class Served:
    url: str
    token: str
    home: Path
    process: subprocess.Popen
    log: Path

    def client(self) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers={"Authorization": f"Bearer {self.token}"}, timeout=30)

    def log_tail(self) -> str:
        return self.log.read_text(errors="replace")[-4000:]


def free_ports(n: int) -> list[int]:
    """n distinct free ports: the sockets are held open together so no port is handed out twice."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for sock in socks:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in socks]
    finally:
        for sock in socks:
            sock.close()


def start_logged(args: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    with log.open("w") as out:  # the child keeps its own handle
        return subprocess.Popen(
            args, env=env, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )


def wait_until(check: Callable[[], bool], what: str, timeout_s: float, logs: list[Path]) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.3)
    tails = "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}" for p in logs if p.exists())
    raise AssertionError(f"{what} within {timeout_s:.0f}s\n{tails}")


def stop(process: subprocess.Popen, timeout_s: float) -> int:
    if process.poll() is None:
        process.terminate()
        try:
            return process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
    return process.wait(10)


def kill_leftovers(tmp: str) -> None:
    """SIGKILL any process still naming our temp dir in its command line or environment (RAY_TMPDIR):
    what a node that died hard left behind. Nothing of another cluster names it."""
    mine = tmp.encode()
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            if mine in (entry / "cmdline").read_bytes() or mine in (entry / "environ").read_bytes():
                os.kill(int(entry.name), signal.SIGKILL)
        except (OSError, ValueError):
            continue


def cluster_env(tmp: str) -> dict[str, str]:
    env = {
        **os.environ,
        "RAY_TMPDIR": tmp,
        "RAY_AUTH_MODE": "token",
        "RAY_AUTH_TOKEN": secrets.token_hex(32),
        "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0",  # a stopped node goes at once, without draining
        "RAY_USAGE_STATS_ENABLED": "0",
        "PYTHONPATH": str(REPO),
        "TOKENIZERS_PARALLELISM": "false",
    }
    for name in ("RAY_ADDRESS", "TANDEM_HOME"):  # the service must learn its home from --home alone
        env.pop(name, None)
    return env


def start_serve(root: Path, env: dict[str, str], token: str, name: str, num_cpus: int = 4) -> Served:
    """`tandem serve` on a home under `root`, with a local Ray of `num_cpus` CPUs, once it is ready."""
    (port,) = free_ports(1)
    url, log = f"http://127.0.0.1:{port}", root / f"{name}.log"
    args = [str(BIN / "tandem"), "serve", "--port", str(port), "--home", str(root / "home"),
            "--num-cpus", str(num_cpus)]  # fmt: skip
    process = start_logged(args, {**env, "TANDEM_ADMIN_TOKEN": token}, log)
    wait_ready(process, url, log, 120)
    return Served(url, token, root / "home", process, log)


def wait_ready(process: subprocess.Popen, url: str, log: Path, timeout_s: float) -> None:
    """Until the `tandem serve` of `process` answers /readyz at `url`; its exit fails with its log."""

    def ready() -> bool:
        assert process.poll() is None, f"tandem serve exited:\n{log.read_text()[-4000:]}"
        try:
            return httpx.get(url + "/readyz", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    wait_until(ready, "tandem serve was not ready", timeout_s, [log])
