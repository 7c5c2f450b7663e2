"""Worker output belongs to the job's log: each worker points its stdout and stderr (the descriptors,
so C extensions are caught too) at `<workdir>/worker_output.log`, and the controller adds that file's
new lines to the job's log at every drain (a progress bar redrawn with "\r": its last state).
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

FILENAME = "worker_output.log"
ENV = "TANDEM_WORKER_OUTPUT"  # the file, handed from the controller to its workers' env


def redirect_output(path: str | Path) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115 - lives as long as the process
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115


class OutputTail:
    """New complete lines of a file since the last read, as job log rows (time, level, line)."""

    def __init__(self, path: str | Path, prefix: str = "[worker] ") -> None:
        self.path, self.prefix = Path(path), prefix
        self._offset = 0

    def read(self) -> list[tuple[float, str, str]]:
        try:
            with self.path.open("rb") as f:
                f.seek(self._offset)
                chunk = f.read()
        except OSError:
            return []
        end = chunk.rfind(b"\n")
        if end < 0:
            return []
        self._offset += end + 1
        now = time.time()
        rows = []
        for raw in chunk[: end + 1].decode(errors="replace").split("\n"):
            line = _last_redraw(raw).rstrip()
            if line:
                rows.append((now, "INFO", self.prefix + line))
        return rows


def _last_redraw(line: str) -> str:
    parts = [p for p in line.split("\r") if p.strip()]
    return parts[-1] if parts else ""
