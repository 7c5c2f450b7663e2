"""The `make run` pipeline for several seeds at once, through one service: how the README's range is measured.

    python -m examples.demo_seeds --seeds 0,1,2 [--home /tmp/demo-seeds]

It starts `tandem serve` on its own home (one local Ray with a CPU per seed), runs for every seed
the demo's two jobs (examples/sft_arithmetic.yaml, then examples/grpo_arithmetic.yaml from the SFT
export, `trainer.seed` set in both) side by side, and prints one JSON line per seed and stage: the
validation curve, the job's minutes, and the final accuracy. The seeds run concurrently, so each
job's minutes are those of a machine shared with the other seeds.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import yaml

from api.client import TandemClient
from examples.demo import EXAMPLES, start_service, val_curve, wait_ready

TERMINAL = ("succeeded", "failed", "cancelled")


def wait_done(client: TandemClient, job_id: str, poll_s: float = 15.0) -> dict[str, Any]:
    while (job := client.get_job(job_id))["status"] not in TERMINAL:
        time.sleep(poll_s)
    return job


def stage(client: TandemClient, seed: int, name: str, spec: dict[str, Any]) -> dict[str, Any]:
    spec["trainer"]["seed"] = seed
    job = wait_done(client, client.create_job(spec)["id"])
    curve = val_curve(client, job["id"])
    line = {"seed": seed, "stage": name, "job": job["id"], "status": job["status"], "error": job["error"],
            "minutes": round((job["finished_at"] - job["started_at"]) / 60, 2), "final": curve[-1][1] if curve else None,
            "curve": curve}  # fmt: skip
    print(json.dumps(line), flush=True)
    return job


def pipeline(url: str, seed: int) -> None:
    client = TandemClient(url=url)
    sft = stage(client, seed, "sft", yaml.safe_load((EXAMPLES / "sft_arithmetic.yaml").read_text()))
    if sft["status"] != "succeeded":
        return
    grpo = yaml.safe_load((EXAMPLES / "grpo_arithmetic.yaml").read_text())
    grpo["model"] = {"path": sft["outputs"]["export"]}
    stage(client, seed, "grpo", grpo)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m examples.demo_seeds", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--seeds", default="0,1,2", help="comma-separated trainer.seed values")
    parser.add_argument("--home", default=None, help="the service's home (default: a new temporary folder)")
    args = parser.parse_args(argv)
    seeds = [int(s) for s in args.seeds.split(",")]
    home = Path(args.home or tempfile.mkdtemp(prefix="tandem-demo-seeds-")).resolve()
    server = start_service(home, ["--num-cpus", str(len(seeds))])
    try:
        url = wait_ready(home, server)
        threads = [threading.Thread(target=pipeline, args=(url, seed)) for seed in seeds]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        server.terminate()
        server.wait(timeout=300)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
