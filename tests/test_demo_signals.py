"""`make run` (examples/demo.py) never leaves its service behind.

The demo starts `tandem serve` as its child. Ctrl-C reaches both through the terminal's process
group; a SIGTERM (`kill`, a CI timeout) or SIGHUP (a closed terminal) reaches the demo alone, and
before the demo handled them its service kept running, holding port 8000 and the home. Here the
demo is started as `make run` starts it, signalled once its service answers, and the service must
then stop on its own: process gone, record gone, port closed, and the demo says which job it paused
and how to resume it. The service's own output (its banner) goes to the home's logs/service.log, not
to the demo's terminal, and holds no "nanobind: leaked" report at its exit.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import tempfile

import pytest

from api.service_record import pid_alive, read_record, record_path
from examples.demo import service_log
from tests.serve_util import cluster_env, free_ports, kill_leftovers, start_logged, wait_until


def port_open(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


# SIGTERM (SIGHUP takes the same handler) reaches the demo alone; Ctrl-C's SIGINT reaches the demo and
# its service together, as a terminal sends it to the whole process group (slow: a second service).
@pytest.mark.parametrize("signum", [signal.SIGTERM, pytest.param(signal.SIGINT, marks=pytest.mark.slow)])
def test_a_terminated_demo_stops_the_service_it_started(tmp_path, signum):
    tmp = tempfile.mkdtemp(prefix="tdemo-")  # short: Ray's socket paths live under it
    home, log = tmp_path / "home", tmp_path / "demo.log"
    (port,) = free_ports(1)
    env = {**cluster_env(tmp), "TANDEM_HOME": str(home), "TANDEM_PORT": str(port)}
    demo = start_logged([sys.executable, "-m", "examples.demo"], env, log)
    try:
        wait_until(lambda: read_record(home) is not None and port_open(port) and "== SFT warm start" in log.read_text(),
                   "the demo submitted its first job", 240, [log])  # fmt: skip
        server_pid = read_record(home)["pid"]
        assert server_pid != demo.pid and pid_alive(server_pid)
        if signum == signal.SIGINT:
            os.killpg(demo.pid, signum)  # the demo leads its own process group (start_new_session)
        else:
            demo.send_signal(signum)
        assert demo.wait(300) == (0 if signum == signal.SIGINT else 128 + signum), log.read_text()[-3000:]
        wait_until(lambda: not pid_alive(server_pid), "the service exited", 120, [log])
        assert not port_open(port) and not record_path(home).exists()
        terminal, service = log.read_text(), service_log(home).read_text()
        assert "Tandem is serving on" in service and "Tandem is serving on" not in terminal, terminal
        assert f"its output goes to {service_log(home)}" in terminal and "nanobind" not in terminal, terminal
        # What happened and how to go on: the job it paused, and the command that resumes it.
        sft_job = terminal.split("== SFT warm start: job ")[1].split()[0]
        assert f"paused {sft_job} (sft" in terminal and "resume from their checkpoints" in terminal, terminal
        assert "`make run`, or `.venv/bin/tandem serve`" in terminal, terminal
        # The service's exit is quiet too: no nanobind leak report (its heap is unfrozen before exit),
        # and no notice of Ray's token authentication at its start.
        assert "nanobind" not in service and "Token authentication is enabled" not in service, service[-3000:]
    finally:
        if demo.poll() is None:
            demo.kill()
        kill_leftovers(tmp)
