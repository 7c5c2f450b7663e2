"""Worker output goes to the job's log: a process that redirects its output writes nothing to its own
terminal, and the controller's tail turns the file into log lines (a redrawn progress bar into its
last state, a line still being written into nothing until it ends)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from controller.worker_output import OutputTail

REPO = Path(__file__).resolve().parents[1]

CHILD = """
import os, sys
from controller.worker_output import redirect_output
redirect_output(sys.argv[1])
print("hello from a worker")
os.write(2, b"raw stderr from C\\n")
sys.stderr.write("Loading weights:   0%|  | 0/51\\rLoading weights: 100%|##| 51/51\\n")
sys.stdout.write("no newline yet")
"""


def test_redirected_output_reaches_the_job_log_and_not_the_terminal(tmp_path):
    log = tmp_path / "worker_output.log"
    child = subprocess.run([sys.executable, "-c", CHILD, str(log)], cwd=REPO, capture_output=True, text=True,
                           timeout=60, env={"PYTHONPATH": str(REPO)})  # fmt: skip
    assert child.returncode == 0, child.stderr
    assert child.stdout == "" and child.stderr == ""
    tail = OutputTail(log)
    lines = [row[2] for row in tail.read()]
    assert lines == [
        "[worker] hello from a worker",
        "[worker] raw stderr from C",
        "[worker] Loading weights: 100%|##| 51/51",
    ]
    assert tail.read() == []  # nothing new; the unfinished line waits for its end
    with log.open("a") as f:
        f.write(" - done\n")
    assert [row[2] for row in tail.read()] == ["[worker] no newline yet - done"]


def test_a_missing_file_is_no_lines(tmp_path):
    assert OutputTail(tmp_path / "never_written.log").read() == []
