"""Where the running service is: `$TANDEM_HOME/service.json` ({"url", "pid", "home", "started_at"}), so
every client of one home finds it on any port. A record whose process is gone is stale and ignored;
one home has one live service.
"""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path
from typing import Any

import httpx

from api.reaper import proc_stat

RECORD = "service.json"


def record_path(home: Path) -> Path:
    return Path(home) / RECORD


def write_record(home: Path, url: str) -> Path:
    """Record this process as the home's service at `url` (written whole, then renamed)."""
    path = record_path(home)
    path.parent.mkdir(parents=True, exist_ok=True)
    body = {"url": url, "pid": os.getpid(), "home": str(home), "started_at": time.time()}
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(body) + "\n")
    tmp.replace(path)
    return path


def read_record(home: Path) -> dict[str, Any] | None:
    """The live service's record, or None when there is none, it is unreadable, or its process is gone."""
    try:
        record = json.loads(record_path(home).read_text())
        pid, url = int(record["pid"]), str(record["url"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return {**record, "pid": pid, "url": url} if pid_alive(pid) else None


def ready_url(home: Path, pid: int | None = None) -> str | None:
    """The URL of the home's live service (of process `pid`) once it answers /readyz, else None."""
    record = read_record(home)
    if record is None or (pid is not None and record["pid"] != pid):
        return None
    try:
        return record["url"] if httpx.get(record["url"] + "/readyz", timeout=5).status_code == 200 else None
    except httpx.HTTPError:
        return None


def remove_record(home: Path) -> None:
    """Remove the record if it is this process's (a newer service's record is left alone)."""
    path = record_path(home)
    try:
        if int(json.loads(path.read_text())["pid"]) == os.getpid():
            path.unlink()
    except (OSError, ValueError, KeyError, TypeError):
        pass


def pid_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, owned by another user
        return True
    stat = proc_stat(pid)  # a process that exited but was not reaped yet still answers kill(pid, 0)
    return stat is None or stat[0] != "Z"


def choose_port(host: str, preferred: int) -> int:
    """`preferred` when it is free, else a free port the system picks."""
    for port in (preferred, 0):
        with socket.socket() as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
            return sock.getsockname()[1]
    raise OSError(f"no free port on {host}")
