"""What every benchmark shares: one JSON line per result, ratios against a baseline measured in the
same run, children that print JSON lines, and a job trained in this process.

A script runs as `python bench/NAME.py` from the checkout's root; it puts the root on sys.path before
importing this module, so that it measures the checkout's own code.
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def emit(bench: str, **fields: Any) -> dict:
    """Print one result as a JSON line (with the 1-minute load average) and return it."""
    line = {"bench": bench, **fields, "load_avg_1m": round(os.getloadavg()[0], 2)}
    print(json.dumps(line), flush=True)
    return line


def ratio(value: float, baseline: float, digits: int = 3) -> float | None:
    """`value / baseline`, rounded; None when the baseline is zero (nothing to compare against)."""
    return round(value / baseline, digits) if baseline else None


def median(values: list[float], digits: int = 4) -> float:
    return round(statistics.median(values), digits)


def percentile(values: list[float], q: int) -> float:
    """The q-th percentile (1-99; 100 is the maximum), interpolated between the samples."""
    if len(values) < 2:
        return values[0] if values else float("nan")
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if 1 <= q <= 99 else max(values)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def git_commit() -> str:
    done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT)
    return done.stdout.strip()


def json_lines(text: str) -> list[dict]:
    """The JSON objects among `text`'s lines (libraries print other lines, some of them dict reprs)."""
    lines = []
    for line in text.splitlines():
        try:
            value = json.loads(line) if line.startswith("{") else None
        except ValueError:
            continue
        if isinstance(value, dict):
            lines.append(value)
    return lines


def run_child(argv: list[str], timeout_s: float, env: dict[str, str] | None = None) -> list[dict]:
    """Run `python ARGV` (a script of bench/ in its own process) and return the JSON lines it printed;
    a failure or a timeout raises, naming the command and the end of its stderr."""
    command = [sys.executable, *argv]
    # ROOT first, then what the caller had (an offline bundle's target folder on a lent GPU machine)
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    full_env = {**os.environ, "PYTHONPATH": path, "TOKENIZERS_PARALLELISM": "false", **(env or {})}
    try:
        done = subprocess.run(command, capture_output=True, text=True, env=full_env, timeout=timeout_s)
    except subprocess.TimeoutExpired as e:
        raise RuntimeError(f"{' '.join(argv[:3])} ran past {timeout_s:.0f} s") from e
    lines = json_lines(done.stdout)
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"{' '.join(argv[:3])} failed (exit {done.returncode}):\n{done.stderr[-4000:]}")
    return lines


def train(spec: dict, name: str, wrap: Callable[[Any, Path], Any] | None = None) -> list[dict]:
    """Train the job `spec` in this process (a local Ray) and return each step's metrics; `wrap` may
    put another sink around the job's (the trackers). The first step includes warm-up: callers drop
    it from timings."""
    from controller.sink import JsonlSink
    from controller.trainer import Trainer
    from schema.job import JobSpec

    workdir = Path(tempfile.mkdtemp(prefix=f"bench-{name}-"))
    inner = JsonlSink(workdir)
    sink = wrap(inner, workdir) if wrap else inner
    Trainer(JobSpec.model_validate(spec), workdir, sink, name=f"bench-{name}").run()
    if sink is not inner and hasattr(sink, "close"):
        sink.close()
    return [r["values"] for r in inner.history]
