"""A service job's start with a warm controller (service/controller_pool.py) against a cold one.

A job's controller actor spends most of its start importing torch, tensordict and transformers. The
service keeps one controller started and imported ahead of the next job (`warm_controllers`, 1 by
default); with 0 each job's controller starts with the job (the behaviour before). This starts a
real service (uvicorn on 127.0.0.1, SQLite, a local Ray) in each mode, rounds alternating, waits
until the warm service's spare controller has imported (a service up for a few seconds), submits a
one-step job of the built-in tiny-qwen2 over HTTP and reads its events: seconds from the submission
to the job's `started` event, to `workers_started` (its controller built the job and its workers
are up), and to `succeeded`. One JSON line per job and one summary with the ratios (warm / cold).

    .venv/bin/python bench/job_start.py [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import ray  # noqa: E402

from api.server import ray_init  # noqa: E402
from api.settings import ServeSettings  # noqa: E402
from tests.api_util import start_service, tiny_job, wait_for  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
MARKS = ("started", "workers_started", "succeeded")


def one_job(warm: int, home: Path) -> dict:
    live = start_service(home, settings=ServeSettings(warm_controllers=warm))
    try:
        for spare in live.service.scheduler.controllers.spares():
            ray.get(spare.pid.remote(), timeout=300)  # imported: the service has been up a while
        with live.client() as api:
            submitted = time.time()
            job = api.post("/v1/jobs", json=tiny_job(trainer={"total_steps": 1})).json()
            done = wait_for(api, job["id"], ("succeeded", "failed"), 600)
            if done["status"] != "succeeded":
                raise RuntimeError(f"the job failed: {done.get('error')}")
            events = api.get(f"/v1/jobs/{job['id']}/events").json()["data"]
        at = {e["kind"]: e["time"] - submitted for e in events if e["kind"] in MARKS}
        return {"warm_controllers": warm, **{f"{k}_s": round(at[k], 2) for k in MARKS}}
    finally:
        live.stop()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    with tempfile.TemporaryDirectory(prefix="job-start-") as tmp:
        os.environ["TANDEM_HOME"] = str(Path(tmp) / "home")
        ray_init(num_cpus=4, include_dashboard=False, logging_level="error", namespace="job-start-bench",
                 runtime_env={"env_vars": {"PYTHONPATH": str(REPO), "TOKENIZERS_PARALLELISM": "false"}})  # fmt: skip
        rows: list[dict] = []
        try:
            for r in range(args.rounds):
                for warm in (1, 0) if r % 2 == 0 else (0, 1):
                    row = one_job(warm, Path(tmp) / f"service-{r}-{warm}")
                    row["round"] = r
                    rows.append(row)
                    print(json.dumps({"bench": "job_start", **row}), flush=True)
        finally:
            ray.shutdown()
    summary: dict = {"bench": "job_start", "summary": True, "rounds": args.rounds,
                     "loadavg_1m": round(os.getloadavg()[0], 2)}  # fmt: skip
    for mark in MARKS:
        warm = statistics.median(r[f"{mark}_s"] for r in rows if r["warm_controllers"] == 1)
        cold = statistics.median(r[f"{mark}_s"] for r in rows if r["warm_controllers"] == 0)
        summary[f"{mark}_s_warm_cold"] = [round(warm, 2), round(cold, 2)]
        summary[f"{mark}_ratio"] = round(warm / cold, 3)
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
