"""One home: `tandem serve` records its URL in $TANDEM_HOME/service.json and the CLI finds it there.

The service record is tested on its own (stale records, another process's record), then a real
`tandem serve` (its own local Ray, uvicorn) is started on a private home with its preferred port
taken: it serves on another port, and `tandem list` with nothing but TANDEM_HOME set reaches it
with the admin token from the same home. A second service on that home is refused; SIGTERM stops
the first cleanly and removes the record.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from api.service_record import (
    choose_port,
    read_record,
    ready_url,
    record_path,
    remove_record,
    write_record,
)

REPO = Path(__file__).resolve().parents[1]


def test_record_round_trip_and_removal(tmp_path):
    write_record(tmp_path, "http://127.0.0.1:8123")
    record = read_record(tmp_path)
    assert record["url"] == "http://127.0.0.1:8123" and record["pid"] == os.getpid()
    remove_record(tmp_path)
    assert not record_path(tmp_path).exists() and read_record(tmp_path) is None


def test_a_dead_services_record_is_stale_and_anothers_is_kept(tmp_path):
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    record_path(tmp_path).write_text(json.dumps({"url": "http://127.0.0.1:9", "pid": gone.pid}))
    assert read_record(tmp_path) is None  # its process is gone
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        record_path(tmp_path).write_text(json.dumps({"url": "http://127.0.0.1:9", "pid": alive.pid}))
        assert read_record(tmp_path)["pid"] == alive.pid
        remove_record(tmp_path)  # not this process's record: left alone
        assert record_path(tmp_path).exists()
    finally:
        alive.kill()
        alive.wait()
    record_path(tmp_path).write_text("{not json")
    assert read_record(tmp_path) is None


def test_choose_port_moves_off_a_taken_port():
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        taken = held.getsockname()[1]
        chosen = choose_port("127.0.0.1", taken)
        assert chosen != taken and chosen > 0
    assert choose_port("127.0.0.1", chosen) == chosen


def _cli(*args: str, env: dict[str, str], timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "api.cli", *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=timeout)  # fmt: skip


@pytest.fixture
def home_env(tmp_path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("TANDEM_URL", "TANDEM_TOKEN", "RAY_ADDRESS")}
    return {**env, "TANDEM_HOME": str(tmp_path / "home"), "PYTHONPATH": str(REPO)}


def test_serve_on_a_taken_port_and_the_cli_finds_it_through_the_home(home_env, tmp_path):
    home = Path(home_env["TANDEM_HOME"])
    log = tmp_path / "serve.log"
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        taken = held.getsockname()[1]
        env = {**home_env, "TANDEM_PORT": str(taken)}
        with log.open("w") as out:
            server = subprocess.Popen([sys.executable, "-m", "api.cli", "serve", "--num-cpus", "1"], cwd=REPO,
                                      env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
        try:
            url = _wait_ready(home, server, log)
            assert not url.endswith(f":{taken}")
            assert f"port {taken} is taken" in log.read_text()
            listed = _cli("list", env=home_env)  # no URL, no token: both come from the home
            assert listed.returncode == 0, listed.stderr
            assert listed.stdout.strip() == "no jobs"
            second = _cli("serve", "--num-cpus", "1", env=home_env)
            assert second.returncode != 0
            assert f"a service already runs on {home.resolve()} at {url}" in second.stderr
            server.send_signal(signal.SIGTERM)
            assert server.wait(timeout=120) == 0, log.read_text()[-3000:]
            assert not record_path(home).exists()
        finally:
            if server.poll() is None:
                os.killpg(server.pid, signal.SIGKILL)
                server.wait(10)


def _wait_ready(home: Path, server: subprocess.Popen, log: Path, timeout_s: float = 240) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert server.poll() is None, f"tandem serve exited:\n{log.read_text()[-3000:]}"
        url = ready_url(home, server.pid)
        if url:
            return url
        time.sleep(0.3)
    raise AssertionError(f"tandem serve was not ready within {timeout_s:.0f}s:\n{log.read_text()[-3000:]}")
