"""The soak (bench/soak.py) in three minutes: a real `tandem serve` under three owners' mixed load
while a chaos thread kills the service or one of its workers every 45 s; the script checks what is
left at the end (jobs ended with a reason, steps stored once, Tinker calls resolved, files and
checkpoints on disk, API p99 between kills) and exits non-zero if a check fails."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.serve_util import REPO


@pytest.mark.slow
def test_a_three_minute_soak_with_kills_passes_its_checks():
    args = [sys.executable, str(REPO / "bench" / "soak.py"), "--minutes", "3", "--chaos-every", "45"]
    done = subprocess.run(args, cwd=REPO, capture_output=True, text=True, timeout=1500)
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    failed = [row for row in rows if row.get("ok") is False]
    assert done.returncode == 0, f"{failed}\n{done.stdout[-6000:]}\n{done.stderr[-3000:]}"
    assert any("kill" in row for row in rows)  # the chaos thread struck at least once
    assert {row["check"] for row in rows if "check" in row} >= {
        "every_job_ended_with_a_stated_reason",
        "every_step_stored_once",
        "every_tinker_call_resolved_or_errored_clearly",
        "api_p99_within_bound",
    }
