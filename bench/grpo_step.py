"""Seconds per GRPO step on the built-in task, by phase, and tokens per second.

Runs short GRPO jobs through the real Trainer on a local Ray (qwen2-1m on 2-digit addition by
default) and prints JSON lines: for each configuration the median step time, each phase's seconds
and share of the step (generation, rewards, old log-probs, update, weight sync), and tokens/s. The
baseline in the same run is the same job with the separate old-log-prob pass forced on
(algorithm.recompute_old_log_probs), so the saving of skipping it is a ratio measured here.

    python bench/grpo_step.py [--steps 6] [--model qwen2-1m] [--n 8] [--prompts 16]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PHASES = ("gen", "reward", "old_log_prob", "adv", "update_actor", "sync")


def run_job(args: argparse.Namespace, recompute: bool) -> list[dict[str, float]]:
    from controller.sink import JsonlSink
    from controller.spec import JobSpec
    from controller.trainer import Trainer

    spec = JobSpec.model_validate(
        {
            "method": "grpo",
            "model": {"builtin": args.model},
            "trainer": {"total_steps": args.steps, "prompts_per_step": args.prompts, "val_every": 0},
            "rollout": {"n": args.n, "max_new_tokens": 4, "free_cache_after_generate": False},
            "optim": {"lr": 5e-4},
            "algorithm": {"recompute_old_log_probs": recompute},
            "checkpoint": {"every": 0, "export_hf": False},
        }
    )
    workdir = Path(tempfile.mkdtemp(prefix="grpo-step-"))
    sink = JsonlSink(workdir)
    Trainer(spec, workdir, sink, name=f"bench-{int(recompute)}").run()
    return [r["values"] for r in sink.history][1:]  # the first step includes warm-up


def summarise(config: str, steps: list[dict[str, float]]) -> dict:
    step_s = statistics.median(s["timing_s/step"] for s in steps)
    phases = {p: statistics.median(s.get(f"timing_s/{p}", 0.0) for s in steps) for p in PHASES}
    tokens = statistics.median(s["perf/total_num_tokens"] for s in steps)
    return {
        "bench": "grpo_step",
        "config": config,
        "steps_timed": len(steps),
        "step_s_median": round(step_s, 4),
        "phase_s": {p: round(v, 4) for p, v in phases.items()},
        "phase_share": {p: round(v / step_s, 3) for p, v in phases.items()},
        "tokens_per_step": tokens,
        "tokens_per_s": round(tokens / step_s, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--model", default="qwen2-1m")
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--prompts", type=int, default=16)
    args = parser.parse_args()
    import ray

    ray.init(num_cpus=4, include_dashboard=False, logging_level="error",
             runtime_env={"env_vars": {"PYTHONPATH": str(Path(__file__).resolve().parents[1])}})  # fmt: skip
    baseline = summarise("recompute_old_log_probs", run_job(args, recompute=True))
    default = summarise("default (old log-probs from the update's forward)", run_job(args, recompute=False))
    default["ratio_step_s_vs_recompute"] = round(default["step_s_median"] / baseline["step_s_median"], 3)
    for line in (baseline, default):
        print(json.dumps(line), flush=True)
    ray.shutdown()


if __name__ == "__main__":
    main()
