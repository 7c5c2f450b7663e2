"""Seconds per GRPO step: TRL's GRPOTrainer against Tandem, same model, data and settings.

Both sides train the same built-in model folder (engines/models/tiny_models.py) on the same 2-digit
addition prompts (written once as train.jsonl), with the same group size, max new tokens, learning
rate, temperature 1 and no KL term (TRL beta 0; Tandem has no KL by default), one optimizer step per
GRPO step. Each side runs with the defaults a user gets: TRL's GRPOTrainer on the CPU, and a
Tandem job with no resources or micro-batch settings in its spec, on a default local Ray.

The sides alternate, each run in a fresh process (TRL, Tandem, TRL, Tandem, ...), so a change in the
machine's load hits both. A step's time is the wall time between the ends of consecutive steps;
the first step of every process (warm-up) is dropped. Prints JSON lines: one per run (a Tandem
run adds its median phase times and the share of rows without advantage), then one summary per
shape with each side's median s/step and the ratio Tandem / TRL, and the load average.

The reward: `arithmetic` (default) scores 1 for the right sum, else 0. A model that cannot add yet
scores 0 on every sample, so every GRPO group has zero advantage and no gradient; Tandem runs such
rows forward only (TRL back-propagates them), so the update costs about a forward. `digits` scores
the share of digit characters in the response, which differs within almost every group: every row
then has a gradient, and the comparison is of the full update.

    python bench/vs_trl.py [--shapes small,large] [--steps 6] [--rounds 2] [--reward digits]
    python bench/vs_trl.py --model smollm2-135m-instruct [--new-tokens 16] [--lora] ...

`--model` runs one shape on any built-in model instead of `--shapes`, the real SmolLM2-135M-Instruct
included (`make install-real`). `--lora` gives both sides adapters of the same rank and targets:
TRL a peft LoraConfig, Tandem `model.lora` (rank 16, alpha 32, every linear layer but the output
projection by default).

Every Tandem run also measures, in its own process before the job starts and again after it ends, the
matrix-product peak and the read bandwidth of the machine (bench/flops.py), and reports per phase the
FLOP/s it reached against the higher of the two: the update's model FLOPs utilisation and generation
against its bound. It also runs a 5 s loop of products before and after (`sustained_matmul_gflops_
before_after`) and gives the update's utilisation against their mean (`update_mfu_sustained`): on a
shared host the burst and the sustained rate part by up to 1.7x. The update's FLOPs depend on the
step (rows without advantage run forward only), so each step's FLOP/s is computed from that step's
own time and rows (`update_gflops_per_step`), and `update_mfu_sustained` is their median's.

Loops minutes away from the update can still miss it: on the AVX-512 host of 2026-11-27 the 5 s
loops of six runs read 141-290 GFLOP/s. So the Tandem side also runs a `--peak-between-steps`
seconds loop (default 2) after every step, while the job's workers wait for the next one, and rates
each timed step's update against the mean of the loops on its two sides
(`update_mfu_between_steps`, per step; `update_mfu_between_steps_median`). The loops' seconds are
taken out of the step times; 0 turns them off.

Loops between steps can still miss the update when the host changes speed within a step (one full
pair rated 0.535 with loops at 256-283 GFLOP/s beside 0.72-0.83 in four child runs).
`--probe-every K` also runs a 2048^3 product after every K-th matrix product of the ranks' training
(bench/mm_probes.py, installed in every Ray worker process), and rates each step's update against
the median of the probes that ran inside it (`update_mfu_probed`, per step and median), the probes'
seconds taken out of the update's and the step's times (so every other figure of the run is on the
net times too).

`--device cuda` trains both sides on the GPU (TRL with bf16 autocast over fp32 weights, as Tandem
computes there) and runs the Tandem side as users do (`--served`, also usable on the CPU): `tandem
serve` in its own process and the job submitted to it (bench/served_job.py), step times from the
metrics' end times. Per phase it then reports generation tokens/s and its share of the floor
(`gen_of_bound`: bf16 weights read once per decode step at the measured bandwidth, plus the FLOPs at
the measured product rate), the sync phase over its own transfer (`sync_over_transfer`), the update's
FLOP/s against the bf16 product rate measured before and after the job (`update_mfu`), and the
rollout backend the job's `building` event names. `--new-tokens 64,256` runs one shape per count.

    python bench/vs_trl.py --device cuda --model qwen2-0.5b --new-tokens 64,256 --reward digits

The sides: bench/trl_side.py and bench/tandem_side.py, over bench/vs_trl_task.py. TRL comes from
the optional `bench` extra (`pip install -e '.[bench]'`; `make bench-trl`).
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.harness import emit, git_commit, median, ratio, run_child  # noqa: E402
from bench.vs_trl_task import LORA, REWARDS, SHAPES, write_prompts  # noqa: E402

CHILD_FLAGS = (
    "steps",
    "n",
    "prompts",
    "lr",
    "reward",
    "peak_between_steps",
    "probe_every",
    "device",
    "job_timeout",
)


def token_counts(text: str) -> list[int]:
    return [int(t) for t in text.split(",")]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="small,large", help=f"comma-separated, from {sorted(SHAPES)}")
    p.add_argument("--model", help="one shape on this built-in model instead of --shapes")
    p.add_argument(
        "--new-tokens", type=token_counts, default=[16], help="max new tokens with --model (a,b,...)"
    )
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where both sides train")
    p.add_argument("--served", action="store_true", help="Tandem through `tandem serve` (always on CUDA)")
    p.add_argument("--job-timeout", type=float, default=1800.0, help="seconds a served job may take")
    p.add_argument("--lora", action="store_true", help="LoRA on both sides (same rank, targets)")
    p.add_argument("--steps", type=int, default=6, help="GRPO steps per run (the first is dropped)")
    p.add_argument("--rounds", type=int, default=2, help="alternating TRL/Tandem pairs per shape")
    p.add_argument("--n", type=int, default=8, help="samples per prompt (group size)")
    p.add_argument("--prompts", type=int, default=16, help="prompts per step")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--reward", choices=sorted(REWARDS), default="arithmetic", help="see above")
    p.add_argument(
        "--peak-between-steps",
        type=float,
        default=2.0,
        help="seconds of matrix products after every Tandem step, to rate its update (0: none)",
    )
    p.add_argument(
        "--probe-every",
        type=int,
        default=0,
        help="a 2048^3 product after every K-th product of the Tandem ranks' training (0: none)",
    )
    p.add_argument(
        "--tandem-set",
        action="append",
        default=[],
        metavar="KEY.PATH=VALUE",
        help="change the Tandem job's spec (a lever to measure; the goal is about the defaults)",
    )
    p.add_argument("--side", choices=("trl", "tandem"), help=argparse.SUPPRESS)
    p.add_argument("--model-dir", help=argparse.SUPPRESS)
    p.add_argument("--train", help=argparse.SUPPRESS)
    p.add_argument("--max-new-tokens", type=int, help=argparse.SUPPRESS)
    return p


def run_side(side: str, args: argparse.Namespace, model_dir: Path, train: Path, max_new_tokens: int) -> dict:
    """One run of one side, in a fresh process: its step times and medians."""
    argv = [__file__, "--side", side, "--model-dir", str(model_dir), "--train", str(train)]
    argv += ["--max-new-tokens", str(max_new_tokens)]
    for flag in CHILD_FLAGS:
        argv += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
    argv += [f"--tandem-set={item}" for item in args.tandem_set]
    argv += (["--lora"] if args.lora else []) + (["--served"] if args.served else [])
    lines = [line for line in run_child(argv, timeout_s=args.job_timeout + 600) if "side" in line]
    if not lines:
        raise RuntimeError(f"the {side} run printed no result")
    return lines[-1]


def child(args: argparse.Namespace) -> None:
    """A child process: one run of one side, printed as one JSON line."""
    if args.side == "trl":
        from bench.trl_side import run_trl

        steps, medians = run_trl(args), {}
    else:
        from bench.tandem_side import run_tandem, run_tandem_served

        steps, medians = (run_tandem_served if args.served else run_tandem)(args)
    emit("vs_trl", side=args.side, step_s=[round(s, 4) for s in steps], medians=medians)


def model_folder(name: str, work: Path) -> Path:
    from controller.models import builtin_model_path
    from engines.models.tiny_models import BUILTIN_MODELS, build_builtin_model

    if name in BUILTIN_MODELS:
        return build_builtin_model(name, work / "models")  # fresh random weights
    return builtin_model_path(name)  # a packaged real model, built once under TANDEM_HOME


def compare(args: argparse.Namespace, shape: str, model_name: str, max_new_tokens: int, train: Path) -> None:
    """Alternating TRL and Tandem runs of one shape: a line per run, then the ratio of the medians."""
    model_dir = model_folder(model_name, train.parent)
    times: dict[str, list[float]] = {"trl": [], "tandem": []}
    for round_index in range(args.rounds):
        for side in ("trl", "tandem"):
            run = run_side(side, args, model_dir, train, max_new_tokens)
            times[side] += run["step_s"]
            emit(
                "vs_trl",
                shape=shape,
                round=round_index,
                side=side,
                step_s_median=median(run["step_s"]),
                step_s=run["step_s"],
                **run["medians"],
            )
    trl, tandem = statistics.median(times["trl"]), statistics.median(times["tandem"])
    emit(
        "vs_trl",
        shape=shape,
        model=model_name,
        params=parameter_count(model_dir),
        prompts=args.prompts,
        n=args.n,
        max_new_tokens=max_new_tokens,
        reward=args.reward,
        device=args.device,
        served=args.served,
        lora=LORA if args.lora else None,
        tandem_set=args.tandem_set,
        steps_timed_per_side=len(times["trl"]),
        trl_s_per_step=round(trl, 4),
        tandem_s_per_step=round(tandem, 4),
        ratio_tandem_vs_trl=ratio(tandem, trl),
        commit=git_commit(),
    )


def main(argv: list[str] | None = None) -> None:
    cli = parser()
    args = cli.parse_args(argv)
    args.served = args.served or args.device == "cuda"
    if args.served and (args.probe_every or args.lora):
        cli.error("--probe-every and --lora run with the in-process Tandem side only (not --served/cuda)")
    if args.side:
        child(args)
        return
    work = Path(tempfile.mkdtemp(prefix="vs-trl-bench-"))
    train = write_prompts(work, args.steps * args.prompts)
    if args.model:
        shapes = [(f"{args.model}@{t}", args.model, t) for t in args.new_tokens]
    else:
        shapes = [(name, *SHAPES[name]) for name in args.shapes.split(",")]
    for shape, model_name, max_new_tokens in shapes:
        compare(args, shape, model_name, max_new_tokens, train)


def parameter_count(model_dir: Path) -> int:
    from safetensors import safe_open

    with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
        return sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())


if __name__ == "__main__":
    main()
