"""Submission-time check of `rollout.environment`: the class is imported in a separate process.

User code never runs in the API process: a child Python (`python -m workers.environments.loader
REF`) imports the reference and checks the class's shape (workers/environments/loader.py), with a
time limit, and reports back as JSON. Built-in names are checked without a process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def environment_problem(ref: str, timeout_s: float = 60.0) -> str | None:
    """None when `ref` names a usable environment class, else why not."""
    if ref.startswith("builtin:"):
        from workers.environments import BUILTIN_ENVIRONMENTS

        name = ref.partition(":")[2]
        if name in BUILTIN_ENVIRONMENTS:
            return None
        choices = ", ".join(f"'builtin:{n}'" for n in sorted(BUILTIN_ENVIRONMENTS))
        return f"environment {ref!r} is not a built-in; choose one of {choices}"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    }
    try:
        out = subprocess.run(
            [sys.executable, "-m", "workers.environments.loader", ref],
            capture_output=True, text=True, timeout=timeout_s, env=env, check=False,
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        return f"environment '{ref}' did not import within {timeout_s:g} s"
    lines = out.stdout.strip().splitlines()
    try:
        verdict = json.loads(lines[-1])
    except (IndexError, json.JSONDecodeError):
        return f"environment '{ref}' could not be checked: {out.stderr.strip()[-500:] or 'no output'}"
    return None if verdict.get("ok") else str(verdict.get("error"))
