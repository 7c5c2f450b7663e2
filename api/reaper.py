"""The Ray processes `tandem serve` started die with it, however it dies.

Killed with SIGKILL, the service takes Ray's GCS and raylet along, but the raylet's agents are
reparented to init and live on. This watcher, in its own session, notes the service's descendants
every second and kills them once the service's pipe closes; a process is known by pid and start
time, so a reused pid is never touched. `watch(pid)` starts it.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
from pathlib import Path

POLL_S = 1.0
Proc = tuple[int, int]  # (pid, start time in clock ticks since boot)


def proc_stat(pid: int) -> tuple[str, int, int] | None:
    """(state, parent pid, start time) of a process, from /proc/PID/stat; None when it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2 :].split()  # the command name may hold spaces and parentheses
    return fields[0], int(fields[1]), int(fields[19])


def descendants(root: int) -> set[Proc]:
    children: dict[int, list[Proc]] = {}
    for entry in Path("/proc").glob("[0-9]*"):
        info = proc_stat(int(entry.name))
        if info is not None:
            children.setdefault(info[1], []).append((int(entry.name), info[2]))
    found: set[Proc] = set()
    todo = [root]
    while todo:
        for proc in children.get(todo.pop(), []):
            if proc not in found:
                found.add(proc)
                todo.append(proc[0])
    return found


def kill_all(procs: set[Proc]) -> int:
    """SIGKILL each process still alive with the same start time; returns how many were killed."""
    killed = 0
    for pid, started in procs:
        if pid == os.getpid():
            continue
        info = proc_stat(pid)
        if info is not None and info[2] == started:
            try:
                os.kill(pid, signal.SIGKILL)
                killed += 1
            except OSError:
                pass
    return killed


def run(pid: int) -> None:
    seen: set[Proc] = set()
    while True:
        ready, _, _ = select.select([sys.stdin], [], [], POLL_S)
        if ready and not sys.stdin.buffer.read1(1):  # EOF: the service's end of the pipe closed
            break
        if proc_stat(pid) is None:
            break
        seen |= descendants(pid)
    kill_all(seen)


def watch(pid: int | None = None) -> subprocess.Popen:
    """Start the watcher of `pid` (this process by default); keep the returned handle open."""
    pid = pid or os.getpid()
    return subprocess.Popen(
        [sys.executable, "-m", "api.reaper", str(pid)],
        stdin=subprocess.PIPE,
        cwd=Path(__file__).resolve().parents[1],
        start_new_session=True,  # a signal to the service's process group does not reach it
    )


if __name__ == "__main__":
    run(int(sys.argv[1]))
