"""Is a step slower with every experiment tracker on? GRPO steps with `trainer.loggers` empty against
the same job with TensorBoard, W&B (offline) and MLflow (a local folder) on.

Runs short GRPO jobs through the real Trainer on a local Ray (qwen2-1m on 2-digit addition, 4 stored
samples a step), alternating off / on for `--rounds` rounds so that the machine's load falls on both
alike, and prints JSON lines: per configuration the median step time over the rounds (the first step
of each job left out: warm-up), the same over the steps after the first 10 (the trackers open in
their thread meanwhile: imports, W&B's service process), the job's wall time including the trackers'
close, and the ratio on / off of the pooled medians and of each round.

    python bench/trackers.py [--steps 20] [--rounds 3] [--quick]
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

TRACKERS = ["tensorboard", "wandb", "mlflow"]


def run_job(steps: int, loggers: list[str]) -> tuple[list[float], float]:
    from controller.sink import JsonlSink
    from controller.trackers import TrackerSink, with_trackers
    from controller.trainer import Trainer
    from schema.job import JobSpec

    workdir = Path(tempfile.mkdtemp(prefix="bench-trackers-"))
    spec = JobSpec.model_validate({
        "method": "grpo", "model": {"builtin": "qwen2-1m"},
        "trainer": {"total_steps": steps, "prompts_per_step": 16, "val_every": 0, "samples_per_step": 4,
                    "loggers": loggers, "mlflow_uri": str(workdir / "mlruns") if "mlflow" in loggers else None},
        "rollout": {"n": 8, "max_new_tokens": 8}, "optim": {"lr": 5e-4},
        "checkpoint": {"every": 0, "export_hf": False},
    })  # fmt: skip
    inner = JsonlSink(workdir)
    sink = with_trackers(
        inner, spec, workdir, f"job-bench{int(bool(loggers))}{int(time.time() * 1000) % 10**6}"
    )
    started = time.perf_counter()
    Trainer(spec, workdir, sink, name="bench").run()
    if isinstance(sink, TrackerSink):
        sink.close()
    wall = time.perf_counter() - started
    return [r["values"]["timing_s/step"] for r in inner.history if "timing_s/step" in r["values"]][1:], wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="8 steps, 2 rounds")
    args = parser.parse_args()
    if args.quick:
        args.steps, args.rounds = 8, 2
    os.environ.setdefault("WANDB_MODE", "offline")
    import ray

    ray.init(num_cpus=4, include_dashboard=False, logging_level="error",
             runtime_env={"env_vars": {"PYTHONPATH": str(Path(__file__).resolve().parents[1])}})  # fmt: skip
    steps: dict[str, list[float]] = {"off": [], "on": []}
    steady: dict[str, list[float]] = {"off": [], "on": []}
    walls: dict[str, list[float]] = {"off": [], "on": []}
    rounds = []
    for _ in range(args.rounds):
        medians = {}
        for config, loggers in (("off", []), ("on", TRACKERS)):
            times, wall = run_job(args.steps, loggers)
            steps[config] += times
            steady[config] += times[9:]
            walls[config].append(wall)
            medians[config] = statistics.median(times)
        rounds.append(round(medians["on"] / medians["off"], 3))
    for config in ("off", "on"):
        print(json.dumps({"bench": "trackers", "config": config, "loggers": TRACKERS if config == "on" else [],
                          "steps_timed": len(steps[config]), "step_s_median": round(statistics.median(steps[config]), 4),
                          "step_s_median_after_10": round(statistics.median(steady[config]), 4),
                          "job_wall_s": [round(w, 2) for w in walls[config]]}), flush=True)  # fmt: skip
    ratio = statistics.median(steps["on"]) / statistics.median(steps["off"])
    ratio_steady = statistics.median(steady["on"]) / statistics.median(steady["off"])
    print(json.dumps({"bench": "trackers", "ratio_step_s_on_vs_off": round(ratio, 3),
                      "ratio_after_10_steps": round(ratio_steady, 3), "per_round": rounds,
                      "load_avg_1m": round(os.getloadavg()[0], 2)}), flush=True)  # fmt: skip
    ray.shutdown()


if __name__ == "__main__":
    main()
