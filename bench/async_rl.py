"""Sync against async RL (trainer.mode, controller/async_loop.py) on the same model, task and seed, in one run.

(a) latency-bound: multi-turn GRPO on the guessing game whose environment steps take 50-500 ms with a
    long tail (bench/slow_envs.py), tiny-qwen2-chat;
(b) compute-bound: single-turn GRPO on the built-in arithmetic task, qwen2-1m, no environment, scored
    by tests.reward_fns:digit_reward (partial credit).

Every job is split (1 training rank, `--rollout-workers` rollout workers). Sync generates then trains;
async runs with max_staleness `--k`, the decoupled correction, and one producer lane per rollout
worker (`rollout_lanes: per_worker`). Prints one JSON line per job: samples trained per second (after
the first step's warm-up), each role's wait (the trainer's wait for a batch; the rollout's wait for
admission or a sync), mean reward against samples consumed; then one line per task with the
async/sync ratios. The reward-per-sample comparison is a short run's: read it as "not worse", not as
a learning curve.

    python bench/async_rl.py [--quick] [--steps 8] [--k 2] [--rollout-workers 3] [--task latency|compute|both]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def job_spec(args: argparse.Namespace, task: str, mode: str) -> dict:
    trainer = {"total_steps": args.steps, "prompts_per_step": args.prompts, "val_every": 0, "seed": 1,
               "samples_per_step": 0}  # fmt: skip
    if mode == "async":
        trainer.update(mode="async", max_staleness=args.k, rollout_lanes="per_worker")
    spec = {
        "method": "grpo",
        "trainer": trainer,
        "optim": {"lr": 5e-4},
        "checkpoint": {"every": 0, "export_hf": False},
        "resources": {"placement": "split", "workers": 1, "cpus_per_worker": 0.5,
                      "rollout": {"workers": args.rollout_workers, "cpus_per_worker": 0.5}},
    }  # fmt: skip
    if task == "latency":
        spec.update(
            model={"builtin": "tiny-qwen2-chat"},
            data={"builtin_task": "guess_number"},
            rollout={"environment": "bench.slow_envs:SlowGuessNumber", "n": args.n, "max_new_tokens": 4,
                     "max_turns": 4, "max_response_tokens": 24},
        )  # fmt: skip
    else:
        spec.update(
            model={"builtin": "qwen2-1m"},
            reward={
                "function": "tests.reward_fns:digit_reward"
            },  # partial credit: a short run's reward moves
            rollout={"n": args.n, "max_new_tokens": 16},
        )
    return spec


def run_job(args: argparse.Namespace, task: str, mode: str) -> dict:
    from controller.async_loop import make_trainer
    from controller.sink import JsonlSink
    from controller.spec import JobSpec

    spec = JobSpec.model_validate(job_spec(args, task, mode))
    workdir = Path(tempfile.mkdtemp(prefix=f"async-rl-{task}-{mode}-"))
    sink = JsonlSink(workdir)
    trainer = make_trainer(spec, workdir, sink, name=f"bench-{task}-{mode}")
    ends: list[float] = []
    progress = sink.progress

    def mark(step, total, values):
        ends.append(time.perf_counter())
        progress(step, total, values)

    sink.progress = mark
    trainer.run()
    rows = [r["values"] for r in sink.history]
    samples = spec.trainer.prompts_per_step * spec.rollout.n
    timed = len(ends) - 1  # steps after the first (warm-up: worker start, first generation)
    seconds = ends[-1] - ends[0]
    return {
        "task": task,
        "mode": mode,
        "steps": len(rows),
        "samples_per_step": samples,
        "samples_trained_per_s": timed * samples / seconds,
        "trainer_wait_s": sum(r.get("async/trainer_wait_s", r.get("timing_s/gen", 0.0)) for r in rows[1:]),
        "rollout_wait_s": sum(r.get("async/rollout_wait_s", 0.0) for r in rows[1:]),
        "staleness_mean": sum(r.get("async/staleness_mean", 0.0) for r in rows) / len(rows),
        "dropped_stale": rows[-1].get("async/dropped_stale_total", 0.0),
        "reward_vs_samples": [
            [(i + 1) * samples, round(r["critic/score/mean"], 4)] for i, r in enumerate(rows)
        ],
        "reward_mean": sum(r["critic/score/mean"] for r in rows) / len(rows),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--k", type=int, default=2)
    parser.add_argument("--rollout-workers", type=int, default=3)
    parser.add_argument("--task", choices=("latency", "compute", "both"), default="both")
    parser.add_argument("--quick", action="store_true", help="5 steps")
    args = parser.parse_args()
    if args.quick:
        args.steps = 5
    import ray

    os.environ.setdefault("TANDEM_HOME", tempfile.mkdtemp(prefix="async-rl-home-"))
    ray.init(namespace="tandem", logging_level="warning", num_cpus=max(os.cpu_count() or 2, 4))
    print(
        json.dumps({"load_average": os.getloadavg(), "cpus": os.cpu_count(), "args": vars(args)}), flush=True
    )
    tasks = ("latency", "compute") if args.task == "both" else (args.task,)
    try:
        for task in tasks:
            sync = run_job(args, task, "sync")
            print(json.dumps(sync), flush=True)
            asynchronous = run_job(args, task, "async")
            print(json.dumps(asynchronous), flush=True)
            ratio = asynchronous["samples_trained_per_s"] / sync["samples_trained_per_s"]
            print(json.dumps({"task": task, "async_over_sync_samples_per_s": round(ratio, 3),
                              "reward_mean_sync": round(sync["reward_mean"], 4),
                              "reward_mean_async": round(asynchronous["reward_mean"], 4),
                              "load_average": os.getloadavg()}), flush=True)  # fmt: skip
    finally:
        ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
