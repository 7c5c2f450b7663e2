"""Sync against async RL (trainer.mode, controller/async_loop.py) on the same model, task and seed, in one run.

(a) latency-bound: multi-turn GRPO on the guessing game whose environment steps take 50-500 ms with a
    long tail (bench/slow_envs.py), tiny-qwen2-chat;
(b) compute-bound: single-turn GRPO on the built-in arithmetic task, qwen2-1m, no environment, scored
    by tests.reward_fns:digit_reward (partial credit).

Every job is split (1 training rank, `--rollout-workers` rollout workers). Sync generates then trains;
async runs with max_staleness `--k` and one producer lane per rollout worker (`rollout_lanes:
per_worker`), once per off-policy correction in `--corrections` (the first, by default the default
decoupled one, is the one the ratio line compares with sync), for every trainer seed in `--seeds`.
`tis-uncapped` is tis with algorithm.rollout_correction.is_cap 1e6: with one update step per batch its
gradient is tinker-cookbook's importance-sampling loss, rho A grad log pi with rho = pi / pi_behav
unclipped. (With this trainer decoupled and tis give the same gradient: their loss configs are equal
and a single on-policy step's old log-probs are the proximal pass's values; a difference between
them measures the run-to-run noise of async timing.)

Prints one JSON line per job: samples trained per second (after the first step's warm-up), each
role's wait (the trainer's wait for a batch; the rollout's wait for admission or a sync), reward
against samples consumed (raw per step, and the mean over each quarter of the run's samples), and the
signs of instability: the largest |log pi_old - log pi_behav| of any token (the importance ratio's
log; the engine mismatch alone in sync), the share of tokens whose weight hit the cap, grad norms
(median and max) and entropy; then one line per task and seed with the async/sync ratios, and a last
line per task with each job's reward by quarter averaged over the seeds.

    python bench/async_rl.py [--quick] [--steps 8] [--k 2] [--rollout-workers 3] [--task latency|compute|both]
        [--lr 5e-4] [--max-response-tokens 24] [--seeds 1,2] [--corrections decoupled,tis,none,tis-uncapped] [--sync-only]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

UNCAPPED = 1e6  # algorithm.rollout_correction.is_cap's largest value: min(rho, C) = rho in practice


def job_spec(
    args: argparse.Namespace, task: str, mode: str, seed: int = 1, correction: str = "decoupled"
) -> dict:
    trainer = {"total_steps": args.steps, "prompts_per_step": args.prompts, "val_every": 0, "seed": seed,
               "samples_per_step": 0}  # fmt: skip
    if mode == "async":
        trainer.update(mode="async", max_staleness=args.k, rollout_lanes="per_worker",
                       off_policy_correction=correction.removesuffix("-uncapped"))  # fmt: skip
    spec = {
        "method": "grpo",
        "trainer": trainer,
        "optim": {"lr": args.lr},
        "checkpoint": {"every": 0, "export_hf": False},
        "resources": {"placement": "split", "workers": 1, "cpus_per_worker": 0.5,
                      "rollout": {"workers": args.rollout_workers, "cpus_per_worker": 0.5}},
    }  # fmt: skip
    if correction == "tis-uncapped":  # the importance weight without its cap: tinker-cookbook's IS loss
        spec["algorithm"] = {"rollout_correction": {"is_cap": UNCAPPED}}
    if task == "latency":
        spec.update(
            model={"builtin": "tiny-qwen2-chat"},
            data={"builtin_task": "guess_number"},
            rollout={"environment": "bench.slow_envs:SlowGuessNumber", "n": args.n, "max_new_tokens": 4,
                     "max_turns": 4, "max_response_tokens": args.max_response_tokens},
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


def quarters(values: list[float]) -> list[float | None]:
    """The mean of each quarter of the steps (equal steps hold equal samples), rounded; None for an
    empty quarter (fewer than 4 steps)."""
    n = len(values)
    cuts = [round(i * n / 4) for i in range(5)]
    return [
        round(statistics.fmean(values[a:b]), 4) if b > a else None
        for a, b in zip(cuts, cuts[1:], strict=False)
    ]


def stability(rows: list[dict]) -> dict:
    """Signs of an unstable update, over the run's steps (absent metrics are left out)."""
    out: dict[str, float] = {}
    diff = [r["rollout/log_prob_diff_max"] for r in rows if "rollout/log_prob_diff_max" in r]
    if diff:  # |log pi_old - log pi_behav| of the worst token: its ratio is exp(+-this)
        out["max_abs_log_ratio"] = round(max(diff), 4)
        out["max_ratio_or_inverse"] = round(math.exp(min(max(diff), 50.0)), 3)
    clipped = [r["rollout_corr/token_clipped_frac"] for r in rows if "rollout_corr/token_clipped_frac" in r]
    if clipped:  # tokens whose weight min(rho, C) hit the cap
        out["capped_token_frac_mean"] = round(statistics.fmean(clipped), 5)
        out["capped_token_frac_max"] = round(max(clipped), 5)
    # a step whose groups all scored alike has no advantage and no gradient: its norm 0 is left out
    all_norms = [r["actor/grad_norm"] for r in rows if "actor/grad_norm" in r]
    norms = [x for x in all_norms if x > 0]
    out["zero_gradient_steps"] = len(all_norms) - len(norms)
    if norms:
        out["grad_norm_median"] = round(statistics.median(norms), 4)
        out["grad_norm_max"] = round(max(norms), 4)
        out["grad_norm_max_over_median"] = round(max(norms) / max(statistics.median(norms), 1e-12), 2)
    entropy = [r["actor/entropy"] for r in rows if "actor/entropy" in r]
    if entropy:
        out["entropy_first_last_quarter"] = [quarters(entropy)[0], quarters(entropy)[-1]]
    return out


def run_job(
    args: argparse.Namespace, task: str, mode: str, seed: int = 1, correction: str = "decoupled"
) -> dict:
    from controller.async_loop import make_trainer
    from controller.sink import JsonlSink
    from controller.spec import JobSpec

    spec = JobSpec.model_validate(job_spec(args, task, mode, seed, correction))
    workdir = Path(tempfile.mkdtemp(prefix=f"async-rl-{task}-{mode}-"))
    sink = JsonlSink(workdir)
    trainer = make_trainer(spec, workdir, sink, name=f"bench-{task}-{mode}")
    ends: list[float] = []
    progress = sink.progress

    def mark(step, total, values):
        ends.append(time.perf_counter())
        progress(step, total, values)

    sink.progress = mark
    started = time.perf_counter()
    trainer.run()
    rows = [r["values"] for r in sink.history]
    samples = spec.trainer.prompts_per_step * spec.rollout.n
    timed = len(ends) - 1  # steps after the first (warm-up: worker start, first generation)
    seconds = ends[-1] - ends[0]
    rewards = [r["critic/score/mean"] for r in rows]
    return {
        "task": task,
        "mode": mode,
        "correction": correction if mode == "async" else None,
        "seed": seed,
        "steps": len(rows),
        "samples_per_step": samples,
        "wall_s": round(time.perf_counter() - started, 1),
        "samples_trained_per_s": timed * samples / seconds,
        "trainer_wait_s": sum(r.get("async/trainer_wait_s", r.get("timing_s/gen", 0.0)) for r in rows[1:]),
        "rollout_wait_s": sum(r.get("async/rollout_wait_s", 0.0) for r in rows[1:]),
        "staleness_mean": sum(r.get("async/staleness_mean", 0.0) for r in rows) / len(rows),
        "dropped_stale": rows[-1].get("async/dropped_stale_total", 0.0),
        "reward_vs_samples": [[(i + 1) * samples, round(x, 4)] for i, x in enumerate(rewards)],
        "reward_mean": sum(rewards) / len(rewards),
        # the mean reward of each quarter of the samples consumed, ending at these sample counts
        "reward_by_quarter": quarters(rewards),
        "quarter_ends_samples": [round(i * len(rows) / 4) * samples for i in range(1, 5)],
        **stability(rows),
    }


def seed_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--k", type=int, default=2)
    parser.add_argument("--lr", type=float, default=5e-4)
    parser.add_argument("--max-response-tokens", type=int, default=24, help="(a): a game's token budget")
    parser.add_argument("--rollout-workers", type=int, default=3)
    parser.add_argument("--task", choices=("latency", "compute", "both"), default="both")
    parser.add_argument("--seeds", type=seed_list, default=[1], help="trainer seeds, comma-separated")
    parser.add_argument(
        "--corrections",
        default="decoupled",
        help="async jobs' trainer.off_policy_correction, comma-separated (decoupled, tis, none, or "
        "tis-uncapped: tis with is_cap 1e6); the first is compared with sync",
    )
    parser.add_argument("--sync-only", action="store_true", help="no async job (to find a learning length)")
    parser.add_argument("--quick", action="store_true", help="5 steps")
    args = parser.parse_args()
    if args.quick:
        args.steps = 5
    corrections = [c for c in args.corrections.split(",") if c]
    import ray

    os.environ.setdefault("TANDEM_HOME", tempfile.mkdtemp(prefix="async-rl-home-"))
    ray.init(namespace="tandem", logging_level="warning", num_cpus=max(os.cpu_count() or 2, 4))
    print(
        json.dumps({"load_average": os.getloadavg(), "cpus": os.cpu_count(), "args": vars(args)}), flush=True
    )
    tasks = ("latency", "compute") if args.task == "both" else (args.task,)
    try:
        for task in tasks:
            by_job: dict[str, list[list[float]]] = {}
            for seed in args.seeds:
                sync = run_job(args, task, "sync", seed)
                print(json.dumps(sync), flush=True)
                by_job.setdefault("sync", []).append(sync["reward_by_quarter"])
                if args.sync_only:
                    continue
                jobs = []
                for correction in corrections:
                    jobs.append(run_job(args, task, "async", seed, correction))
                    print(json.dumps(jobs[-1]), flush=True)
                    by_job.setdefault(f"async-{correction}", []).append(jobs[-1]["reward_by_quarter"])
                ratio = jobs[0]["samples_trained_per_s"] / sync["samples_trained_per_s"]
                print(json.dumps({"task": task, "seed": seed, "correction": corrections[0],
                                  "async_over_sync_samples_per_s": round(ratio, 3),
                                  "reward_mean_sync": round(sync["reward_mean"], 4),
                                  "reward_mean_async": round(jobs[0]["reward_mean"], 4),
                                  "reward_last_quarter_sync": sync["reward_by_quarter"][-1],
                                  "reward_last_quarter_async": jobs[0]["reward_by_quarter"][-1],
                                  "load_average": os.getloadavg()}), flush=True)  # fmt: skip
            mean = {job: [round(statistics.fmean(q), 4) if None not in q else None for q in zip(*runs, strict=True)]
                    for job, runs in by_job.items()}  # fmt: skip
            print(json.dumps({"task": task, "seeds": args.seeds, "k": args.k,
                              "reward_by_quarter_mean_over_seeds": mean,
                              "load_average": os.getloadavg()}), flush=True)  # fmt: skip
    finally:
        ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
