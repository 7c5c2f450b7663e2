"""The API process's start-up: seconds from `tandem serve` to a ready service, and its memory.

Starts the real `tandem serve` (its own local Ray, a fresh TANDEM_HOME) `--rounds` times and prints
one JSON line per round and a summary: seconds until /readyz answers 200, the API process's
resident memory (VmRSS from /proc) once ready, and whether the process has torch or transformers
loaded (from `GET /v1/service`, the process's own sys.modules, where the route exists). The
baseline is the bare interpreter's start and memory, measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.harness import free_port  # noqa: E402


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def bare_python() -> tuple[float, float]:
    start = time.perf_counter()
    out = subprocess.run(
        [sys.executable, "-c", "import resource; print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    return time.perf_counter() - start, int(out.stdout) / 1024


def one_round(timeout_s: float) -> dict:
    port = free_port()
    home = tempfile.mkdtemp(prefix="tandem-startup-")
    token = "tdm_bench_startup_admin"
    env = {**os.environ, "TANDEM_HOME": home, "PYTHONPATH": str(REPO), "TANDEM_ADMIN_TOKEN": token}
    start = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, "-m", "api.cli", "serve", "--port", str(port), "--num-cpus", "2"],
        cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        while True:
            if time.perf_counter() - start > timeout_s:
                raise TimeoutError(f"tandem serve was not ready within {timeout_s:.0f} s")
            try:
                if httpx.get(f"{url}/readyz", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        ready_s = time.perf_counter() - start
        info = httpx.get(f"{url}/v1/service", headers={"Authorization": f"Bearer {token}"}, timeout=10)
        modules = info.json().get("modules") if info.status_code == 200 else None
        return {"ready_s": ready_s, "rss_mb": rss_mb(proc.pid), "modules": modules}
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--timeout-s", type=float, default=180)
    args = parser.parse_args()
    base_s, base_mb = bare_python()
    rounds = []
    for i in range(args.rounds):
        r = one_round(args.timeout_s)
        rounds.append(r)
        print(json.dumps({"bench": "api_startup", "round": i, **r}), flush=True)
    ready = statistics.median(r["ready_s"] for r in rounds)
    rss = statistics.median(r["rss_mb"] for r in rounds)
    print(json.dumps({
        "bench": "api_startup", "summary": True, "ready_s": ready, "rss_mb": rss,
        "bare_python_s": base_s, "bare_python_mb": base_mb,
        "ready_vs_bare": ready / base_s, "rss_vs_bare": rss / base_mb,
        "loadavg": os.getloadavg()[0],
    }))  # fmt: skip


if __name__ == "__main__":
    main()
