"""Seconds per GRPO step with the rollout colocated (the hybrid worker) and split (a rollout worker
of its own, weights sent by `rollout.weight_transfer`), in one run.

Short GRPO jobs through the real Trainer on a local Ray (qwen2-1m on the built-in task by default),
the same seed and settings apart from resources.placement: colocated on `--workers` training
ranks, split on the same training ranks plus `--rollout-workers` rollout workers. Prints one JSON
line per configuration (median step seconds over the steps after the first, each phase's
seconds) and the split/colocated ratio. On a 2-core machine the split job's processes compete for
the same cores, so the ratio measures overhead (the transfer, the extra process), not overlap.

    python bench/placement.py [--steps 5] [--model qwen2-1m] [--workers 1] [--rollout-workers 1] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

PHASES = ("gen", "reward", "update_actor", "sync")


def run_job(args: argparse.Namespace, placement: str, transfer: str = "collective") -> list[dict[str, float]]:
    from controller.sink import JsonlSink
    from controller.trainer import Trainer
    from schema.job import JobSpec

    resources: dict = {"workers": args.workers}
    if placement == "split":
        resources.update(placement="split", rollout={"workers": args.rollout_workers})
    spec = JobSpec.model_validate(
        {
            "method": "grpo",
            "model": {"builtin": args.model},
            "trainer": {
                "total_steps": args.steps,
                "prompts_per_step": args.prompts,
                "val_every": 0,
                "seed": 1,
            },
            "rollout": {"n": args.n, "max_new_tokens": 8, "weight_transfer": transfer},
            "optim": {"lr": 5e-4},
            "checkpoint": {"every": 0, "export_hf": False},
            "resources": resources,
        }
    )
    workdir = Path(tempfile.mkdtemp(prefix=f"placement-{placement}-"))
    sink = JsonlSink(workdir)
    Trainer(spec, workdir, sink, name=f"bench-{placement}-{transfer}").run()
    return [r["values"] for r in sink.history][1:]  # the first step includes warm-up


def summarise(config: str, steps: list[dict[str, float]]) -> dict:
    step_s = statistics.median(s["timing_s/step"] for s in steps)
    return {
        "bench": "placement",
        "config": config,
        "steps_timed": len(steps),
        "step_s_median": round(step_s, 4),
        "phase_s": {
            p: round(statistics.median(s.get(f"timing_s/{p}", 0.0) for s in steps), 4) for p in PHASES
        },
        "weight_sync_gbps": round(statistics.median(s.get("weight_sync/gbps", 0.0) for s in steps), 3),
        "loadavg_1m": round(os.getloadavg()[0], 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=None, help="default 6 (4 with --quick)")
    parser.add_argument("--model", default="qwen2-1m")
    parser.add_argument("--workers", type=int, default=1, help="training ranks")
    parser.add_argument("--rollout-workers", type=int, default=1)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    args.steps = args.steps or (4 if args.quick else 6)
    import ray

    ray.init(num_cpus=6, include_dashboard=False, logging_level="error",
             runtime_env={"env_vars": {"PYTHONPATH": str(REPO)}})  # fmt: skip
    colocated = summarise("colocated", run_job(args, "colocated"))
    lines = [colocated]
    for transfer in ("collective", "object_store"):
        split = summarise(f"split ({transfer})", run_job(args, "split", transfer))
        split["ratio_step_s_vs_colocated"] = round(split["step_s_median"] / colocated["step_s_median"], 3)
        lines.append(split)
    for line in lines:
        print(json.dumps(line), flush=True)
    ray.shutdown()


if __name__ == "__main__":
    main()
