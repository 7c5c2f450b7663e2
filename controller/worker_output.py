"""Worker output belongs to the job's log, not to the terminal that runs the service.

What a job's worker processes print (a model loader's progress bars, library warnings, a stray
`print`) is written to one file in the job's folder: each worker, on start, points its stdout and
stderr (the file descriptors, so C extensions are caught too) at `<workdir>/worker_output.log`. The
job's controller reads that file's new lines at every drain and adds them to the job's log, so
`tandem logs JOB` shows them. A progress bar redrawn with carriage returns becomes its last state.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

FILENAME = "worker_output.log"
ENV = "TANDEM_WORKER_OUTPUT"  # the file, handed from the controller to its workers' env


def redirect_output(path: str | Path) -> None:
    """Send this process's stdout and stderr to `path` (appended, line-buffered)."""
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
    """The text a terminal would show for a line redrawn with carriage returns (a progress bar)."""
    parts = [p for p in line.split("\r") if p.strip()]
    return parts[-1] if parts else ""
