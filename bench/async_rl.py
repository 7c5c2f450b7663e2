"""Sync against async RL (trainer.mode, controller/async_loop.py) on the same model, task and seed, in one run.

(a) latency-bound: multi-turn GRPO on the guessing game whose environment steps take 50-500 ms with a
    long tail (bench/slow_envs.py), tiny-qwen2-chat;
(b) compute-bound: single-turn GRPO on the built-in arithmetic task, qwen2-1m, no environment, scored
    by tests.reward_fns:digit_reward (partial credit).

Every job is split (1 training rank, `--rollout-workers` rollout workers). Sync generates then trains;
async runs with the spec's defaults (`rollout_lanes: auto`, max_staleness resolved from the lanes:
per_worker with k = rollout workers - 1 on both tasks) unless `--k` / `--lanes`
set them, once per off-policy
correction in `--corrections` (the first, by default the default decoupled one, is the one the ratio
line compares with sync), for every trainer seed in `--seeds`.
`tis-uncapped` is tis with algorithm.rollout_correction.is_cap 1e6: with one update step per batch its
gradient is tinker-cookbook's importance-sampling loss, rho A grad log pi with rho = pi / pi_behav
unclipped. (With this trainer decoupled and tis give the same gradient: their loss configs are equal
and a single on-policy step's old log-probs are the proximal pass's values; a difference between
them measures the run-to-run noise of async timing. With several optimizer steps per batch,
`--mini-batch` / `--epochs`, tis runs the proximal pass too and is the same loss as decoupled.)
`behaviour_ppo` is AReaL's plain-PPO baseline (PPO clipped around pi_behav, no proximal pass);
`is-unclipped` is behaviour_ppo with the widest clip ranges the spec allows (clip_ratio_low /
_high 100, clip_ratio_c 1e6): -rho A with rho = pi_theta / pi_behav unclipped up to rho = 101, which
is tinker-cookbook's importance-sampling loss for any number of optimizer steps per batch.

Held-out reward (`--val-every N`): the job's own validation (controller/trainer.py: answers to the
task's held-out split, `trainer.val_size` of them, sampled with a fixed seed, `trainer.val_greedy`
false, or greedy with `--val-greedy`) every N steps and at step 0, so the
*trained* weights are scored at equal samples consumed in both modes (the reward of the trained
samples, below, is that of the older weights that generated them: it lags in async by construction).
An async validation holds the rollout workers to itself (the lanes wait, as sync's generation does),
and every validation's time is left out of the samples/s.

Prints one JSON line per job: samples trained per second (after the first step's warm-up), each
role's wait (the trainer's wait for a batch; the rollout's wait for admission or a sync), reward
against samples consumed (raw per step, and the mean over each quarter of the run's samples), and the
signs of instability: the largest |log pi_old - log pi_behav| of any token (the importance ratio's
log; the engine mismatch alone in sync), the share of tokens whose weight hit the cap, grad norms
(median and max) and entropy; then one line per task and seed with the async/sync ratios, and a last
line per task with each job's reward by quarter averaged over the seeds.

    python bench/async_rl.py [--quick] [--steps 8] [--k 2] [--rollout-workers 3] [--task latency|compute|both]
        [--val-every 5] [--val-size 64]
        [--lr 5e-4] [--max-response-tokens 24] [--seeds 1,2] [--mini-batch 4] [--epochs 2]
        [--corrections decoupled,tis,none,tis-uncapped,behaviour_ppo,is-unclipped] [--lanes auto|group|per_worker] [--sync-only]
        [--windows 80,160,320,480] [--out bench/results/NAME.jsonl]
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
UNCLIPPED = {"clip_ratio_low": 100.0, "clip_ratio_high": 100.0, "clip_ratio_c": 1e6}  # the spec's widest
COLLAPSE = 0.5  # a job "collapsed" when its last 5 steps' mean reward is below this share of its best


ARM_CORRECTION = {"tis-uncapped": "tis", "is-unclipped": "behaviour_ppo"}  # the bench's arms' settings


def job_spec(
    args: argparse.Namespace, task: str, mode: str, seed: int = 1, correction: str = "decoupled"
) -> dict:
    trainer = {"total_steps": args.steps, "prompts_per_step": args.prompts, "val_every": 0, "seed": seed,
               "samples_per_step": 0}  # fmt: skip
    if args.val_every:
        trainer.update(val_every=args.val_every, val_size=args.val_size, val_greedy=args.val_greedy)
    if mode == "async":
        trainer.update(mode="async", off_policy_correction=ARM_CORRECTION.get(correction, correction))
        if args.k is not None:
            trainer["max_staleness"] = args.k
        if args.lanes is not None:
            trainer["rollout_lanes"] = args.lanes
    spec = {
        "method": "grpo",
        "trainer": trainer,
        "optim": {"lr": args.lr},
        "checkpoint": {"every": 0, "export_hf": False},
        "resources": {"placement": "split", "workers": 1, "cpus_per_worker": 0.5,
                      "rollout": {"workers": args.rollout_workers, "cpus_per_worker": 0.5}},
    }  # fmt: skip
    algorithm: dict = {"ppo_epochs": args.epochs}
    if args.mini_batch:
        algorithm["ppo_mini_batch_size"] = args.mini_batch
    if mode == "async" and correction == "tis-uncapped":  # the importance weight without its cap
        algorithm["rollout_correction"] = {"is_cap": UNCAPPED}
    if mode == "async" and correction == "is-unclipped":  # tinker-cookbook's importance-sampling loss
        algorithm.update(UNCLIPPED)
    spec["algorithm"] = algorithm
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


def windows(rewards: list[float], samples: int, ends: list[int]) -> dict[str, float]:
    """The mean reward of the trained samples in each window of samples consumed ("1-80": ...)."""
    out, start = {}, 0
    for end in [*ends, len(rewards) * samples]:
        picked = [x for i, x in enumerate(rewards) if start < (i + 1) * samples <= end]
        if picked:
            out[f"{start + 1}-{end}"] = round(statistics.fmean(picked), 4)
        start = end
    return out


def collapsed(rewards: list[float]) -> bool:
    """The last 5 steps' mean reward below COLLAPSE x the best 5-step mean (a reward that rose and fell)."""
    means = [statistics.fmean(rewards[i : i + 5]) for i in range(max(len(rewards) - 4, 1))]
    return bool(means) and max(means) > 0 and means[-1] < COLLAPSE * max(means)


def stability(rows: list[dict]) -> dict:
    """Signs of an unstable update, over the run's steps (absent metrics are left out)."""
    out: dict[str, float] = {}
    diff = [r["rollout/log_prob_diff_max"] for r in rows if "rollout/log_prob_diff_max" in r]
    if diff:  # |log pi_old - log pi_behav| of the worst token: its ratio is exp(+-this)
        out["max_abs_log_ratio"] = round(max(diff), 4)
        out["max_ratio_or_inverse"] = round(math.exp(min(max(diff), 50.0)), 3)
    ratio = [r["actor/log_ratio_max"] for r in rows if "actor/log_ratio_max" in r]
    if ratio:  # the PPO ratio's (pi_theta / pi_old) farthest token over the update's optimizer steps
        out["max_abs_ppo_log_ratio"] = round(max(ratio), 4)
    ppo_clip = [r["actor/pg_clipfrac"] for r in rows if "actor/pg_clipfrac" in r]
    if ppo_clip:  # tokens whose PPO ratio was clipped (no gradient)
        out["pg_clipfrac_mean"] = round(statistics.fmean(ppo_clip), 5)
        out["pg_clipfrac_max"] = round(max(ppo_clip), 5)
    clipped = [r["rollout_corr/token_clipped_frac"] for r in rows if "rollout_corr/token_clipped_frac" in r]
    if clipped:  # tokens whose weight min(rho, C) hit the cap
        out["capped_token_frac_mean"] = round(statistics.fmean(clipped), 5)
        out["capped_token_frac_max"] = round(max(clipped), 5)
    # a step whose groups all scored alike has no advantage and no gradient: its norm 0 is left out
    all_norms = [r["actor/grad_norm"] for r in rows if "actor/grad_norm" in r]
    norms = [x for x in all_norms if x > 0]
    out["zero_gradient_steps"] = len(all_norms) - len(norms)
    step_max = [r.get("actor/grad_norm_max", r["actor/grad_norm"]) for r in rows if "actor/grad_norm" in r]
    if norms:
        out["grad_norm_median"] = round(statistics.median(norms), 4)
        out["grad_norm_max"] = round(max(step_max), 4)  # the largest single optimizer step's
        out["grad_norm_max_over_median"] = round(max(norms) / max(statistics.median(norms), 1e-12), 2)
    losses = [r["actor/pg_loss"] for r in rows if "actor/pg_loss" in r]
    out["non_finite_loss_steps"] = sum(not math.isfinite(x) for x in losses)
    entropy = [r["actor/entropy"] for r in rows if "actor/entropy" in r]
    if entropy:
        out["entropy_first_last_quarter"] = [quarters(entropy)[0], quarters(entropy)[-1]]
    return out


def run_job(
    args: argparse.Namespace, task: str, mode: str, seed: int = 1, correction: str = "decoupled"
) -> dict:
    from controller.sink import JsonlSink
    from controller.trainer import Trainer
    from schema.async_rl import resolved_lanes, staleness_bound
    from schema.job import JobSpec

    spec = JobSpec.model_validate(job_spec(args, task, mode, seed, correction))
    workdir = Path(tempfile.mkdtemp(prefix=f"async-rl-{task}-{mode}-"))
    sink = JsonlSink(workdir)
    trainer = Trainer(spec, workdir, sink, name=f"bench-{task}-{mode}")
    ends: list[float] = []
    progress = sink.progress

    def mark(step, total, values):
        ends.append(time.perf_counter())
        progress(step, total, values)

    sink.progress = mark
    validations: list[tuple[int, float, float]] = []  # (step, held-out reward, seconds)
    validate = trainer.validate

    def timed_validate() -> dict[str, float]:
        start = time.perf_counter()
        out = validate()
        validations.append(
            (trainer.step_index, out.get("val/score/mean", math.nan), time.perf_counter() - start)
        )
        return out

    trainer.validate = timed_validate
    hold_waits: list[float] = []  # async: a validation's wait for the lanes' calls in flight to end
    turn = getattr(trainer, "turn", None)
    if turn is not None:
        hold = turn.hold

        def timed_hold(timeout_s: float) -> bool:
            start = time.perf_counter()
            try:
                return hold(timeout_s)
            finally:
                hold_waits.append(time.perf_counter() - start)

        turn.hold = timed_hold
    started = time.perf_counter()
    trainer.run()
    rows = [r["values"] for r in sink.history if r["step"] >= 1]  # step 0: the first validation only
    samples = spec.trainer.prompts_per_step * spec.rollout.n
    timed = len(ends) - 1  # steps after the first (warm-up: worker start, first generation)
    # a validation's time is not training time (the first step's and step 0's are before ends[0])
    seconds = ends[-1] - ends[0] - sum(s for step, _, s in validations if step >= 2)
    # the lanes work while a validation waits for their calls to end: counted as training time, that
    # wait gives the conservative figure (the trainer idles meanwhile, which it would not unvalidated)
    later = sum(step >= 2 for step, _, _ in validations)
    waited = sum(hold_waits[len(hold_waits) - later :]) if later and hold_waits else 0.0
    rewards = [r["critic/score/mean"] for r in rows]
    return {
        "task": task,
        "mode": mode,
        "correction": correction if mode == "async" else None,
        "lanes": resolved_lanes(spec) if mode == "async" else None,
        "max_staleness": staleness_bound(spec) if mode == "async" else None,
        "seed": seed,
        "steps": len(rows),
        "samples_per_step": samples,
        "wall_s": round(time.perf_counter() - started, 1),
        "load_average": os.getloadavg(),
        "samples_trained_per_s": timed * samples / seconds,
        "samples_trained_per_s_hold_wait_counted": timed * samples / (seconds + waited),
        "validation_hold_wait_s": round(waited, 2),
        "trainer_wait_s": sum(r.get("async/trainer_wait_s", r.get("timing_s/gen", 0.0)) for r in rows[1:]),
        "rollout_wait_s": sum(r.get("async/rollout_wait_s", 0.0) for r in rows[1:]),
        "staleness_mean": sum(r.get("async/staleness_mean", 0.0) for r in rows) / len(rows),
        "staleness_max": max(r.get("async/staleness_max", 0.0) for r in rows),
        "optimizer_steps_per_batch": rows[-1].get("actor/optimizer_steps"),
        "dropped_stale": rows[-1].get("async/dropped_stale_total", 0.0),
        "reward_vs_samples": [[(i + 1) * samples, round(x, 4)] for i, x in enumerate(rewards)],
        # the trained weights' greedy reward on the held-out games, at samples consumed
        "heldout_vs_samples": [[step * samples, round(x, 4)] for step, x, _ in validations],
        "validation_s": round(sum(s for _, _, s in validations), 2),
        "reward_mean": sum(rewards) / len(rewards),
        # the mean reward of each quarter of the samples consumed, ending at these sample counts
        "reward_by_quarter": quarters(rewards),
        "reward_by_window": windows(rewards, samples, args.windows),
        "collapsed": collapsed(rewards),
        "quarter_ends_samples": [round(i * len(rows) / 4) * samples for i in range(1, 5)],
        **stability(rows),
    }


def mean_sd(values: list[float]) -> list[float]:
    """[mean, sample sd] rounded (sd 0 for one value)."""
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return [round(statistics.fmean(values), 4), round(sd, 4)]


def spread(ratios: list[float], heldout: dict[str, list[list[list[float]]]]) -> dict:
    """Over the seeds: the async/sync ratio's mean and sd; each job's held-out reward at each sample
    count (mean, sd); and async minus sync per seed at each sample count."""
    out: dict = {"async_over_sync_mean_sd": mean_sd(ratios) if ratios else None}
    curves = {}
    for job, runs in heldout.items():
        at = [dict(map(tuple, run)) for run in runs]
        counts = sorted(set.intersection(*(set(a) for a in at))) if at else []
        curves[job] = {n: [a[n] for a in at] for n in counts}
    out["heldout_mean_sd"] = {job: {n: mean_sd(v) for n, v in c.items()} for job, c in curves.items()}
    sync = curves.get("sync", {})
    for job, c in curves.items():
        if job != "sync":
            out[f"heldout_{job}_minus_sync_per_seed"] = {
                n: [round(a - b, 4) for a, b in zip(v, sync[n], strict=True)]
                for n, v in c.items()
                if n in sync
            }
    return out


def seed_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--k", type=int, default=None, help="trainer.max_staleness (default: the spec's)")
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
    parser.add_argument("--lanes", choices=("auto", "per_worker", "group"), default=None,
                        help="trainer.rollout_lanes of the async jobs (default: the spec's)")  # fmt: skip
    parser.add_argument(
        "--val-every",
        type=int,
        default=0,
        help="held-out reward of the trained weights every N steps (trainer.val_every)",
    )
    parser.add_argument("--val-size", type=int, default=64, help="trainer.val_size (held-out games)")
    parser.add_argument(
        "--val-greedy",
        action="store_true",
        help="greedy validation (default: sampled with a fixed seed, trainer.val_greedy false)",
    )
    parser.add_argument(
        "--mini-batch", type=int, default=0, help="algorithm.ppo_mini_batch_size (0: the batch)"
    )
    parser.add_argument("--epochs", type=int, default=1, help="algorithm.ppo_epochs")
    parser.add_argument("--windows", type=seed_list, default=[80, 160, 320, 480], help="reward windows' ends")
    parser.add_argument("--out", type=Path, help="also append the lines to this file")
    parser.add_argument("--sync-only", action="store_true", help="no async job (to find a learning length)")
    parser.add_argument("--quick", action="store_true", help="5 steps")
    args = parser.parse_args()
    if args.quick:
        args.steps = 5
    corrections = [c for c in args.corrections.split(",") if c]
    import ray

    os.environ.setdefault("TANDEM_HOME", tempfile.mkdtemp(prefix="async-rl-home-"))
    ray.init(namespace="tandem", logging_level="warning", num_cpus=max(os.cpu_count() or 2, 4))

    def emit(line: dict) -> None:
        text = json.dumps(line, default=str)
        print(text, flush=True)
        if args.out is not None:
            with args.out.open("a") as out:
                out.write(text + "\n")

    commit = os.popen(f"git -C {REPO} rev-parse --short HEAD").read().strip()
    emit({"load_average": os.getloadavg(), "cpus": os.cpu_count(), "commit": commit, "args": vars(args)})
    tasks = ("latency", "compute") if args.task == "both" else (args.task,)
    try:
        for task in tasks:
            by_job: dict[str, list[list[float]]] = {}
            heldout: dict[str, list[list[list[float]]]] = {}  # job -> per seed [[samples, reward], ...]
            ratios: list[float] = []
            for seed in args.seeds:
                sync = run_job(args, task, "sync", seed)
                emit(sync)
                by_job.setdefault("sync", []).append(sync["reward_by_quarter"])
                heldout.setdefault("sync", []).append(sync["heldout_vs_samples"])
                if args.sync_only:
                    continue
                jobs = []
                for correction in corrections:
                    jobs.append(run_job(args, task, "async", seed, correction))
                    emit(jobs[-1])
                    by_job.setdefault(f"async-{correction}", []).append(jobs[-1]["reward_by_quarter"])
                    heldout.setdefault(f"async-{correction}", []).append(jobs[-1]["heldout_vs_samples"])
                ratio = jobs[0]["samples_trained_per_s"] / sync["samples_trained_per_s"]
                ratios.append(ratio)
                emit({"task": task, "seed": seed, "correction": corrections[0],
                      "async_over_sync_samples_per_s": round(ratio, 3),
                      "reward_mean_sync": round(sync["reward_mean"], 4),
                      "reward_mean_async": round(jobs[0]["reward_mean"], 4),
                      "reward_last_quarter_sync": sync["reward_by_quarter"][-1],
                      "reward_last_quarter_async": jobs[0]["reward_by_quarter"][-1],
                      "heldout_sync": sync["heldout_vs_samples"], "heldout_async": jobs[0]["heldout_vs_samples"],
                      "load_average": os.getloadavg()})  # fmt: skip
            mean = {job: [round(statistics.fmean(q), 4) if None not in q else None for q in zip(*runs, strict=True)]
                    for job, runs in by_job.items()}  # fmt: skip
            emit({"task": task, "seeds": args.seeds, "k": args.k,
                  "reward_by_quarter_mean_over_seeds": mean, "load_average": os.getloadavg(),
                  **spread(ratios, heldout)})  # fmt: skip
    finally:
        ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
