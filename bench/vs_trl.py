"""Seconds per GRPO step: TRL's GRPOTrainer against Tandem, same model, data and settings.

Both sides train the same built-in model folder (engines/tiny_models.py) on the same 2-digit
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

TRL comes from the optional `bench` extra (`pip install -e '.[bench]'`; `make bench-trl`).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# shape name -> (built-in model, max new tokens), the two shapes of issue 17.
SHAPES = {"small": ("qwen2-1m", 8), "large": ("qwen2-20m", 32)}
LORA = {"rank": 16, "alpha": 32.0}  # --lora: the same on both sides, all linear layers


def write_prompts(folder: Path, rows: int) -> Path:
    from controller.tasks.arithmetic import ArithmeticTask

    train, _ = ArithmeticTask().write_jsonl(folder, train_size=rows, val_size=1, seed=0)
    return train


def digit_share(prompt: str, response: str, ground_truth: object, extra: dict | None = None) -> dict:
    """The `digits` reward: the share of the response's characters that are digits."""
    return {"score": sum(c.isdigit() for c in response) / max(len(response), 1)}


REWARDS = {"arithmetic": "builtin:arithmetic", "digits": f"{Path(__file__).resolve()}:digit_share"}


def reward_function(name: str):
    """The reward as a Python function (the TRL side)."""
    if name == "digits":
        return digit_share
    from controller.tasks.arithmetic import arithmetic_reward

    return arithmetic_reward


def step_intervals(ends: list[float], paused: list[float] | None = None) -> list[float]:
    """Seconds of each step after the first (the first includes warm-up), less the seconds spent
    measuring the machine after the step before it (`paused[i]`: after the step that ended at ends[i])."""
    paused = paused or [0.0] * len(ends)
    return [b - a - p for a, b, p in zip(ends[:-1], ends[1:], paused, strict=False)]


# ---- the TRL side ------------------------------------------------------------------------------


def run_trl(args: argparse.Namespace) -> list[float]:
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    score_fn = reward_function(args.reward)
    rows = [json.loads(line) for line in Path(args.train).read_text().splitlines()]
    tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    # Tandem renders a prompt through the tokenizer's chat template when it has one
    # (controller/data.py); TRL does the same for a conversational prompt, so both see the same tokens.
    chat = bool(getattr(tokenizer, "chat_template", None))
    dataset = Dataset.from_list(
        [
            {"prompt": [{"role": "user", "content": r["prompt"]}] if chat else r["prompt"],
             "ground_truth": r["ground_truth"]}
            for r in rows
        ]
    )  # fmt: skip

    def text(item: str | list[dict]) -> str:
        return item if isinstance(item, str) else item[-1]["content"]

    def reward(prompts: list, completions: list, ground_truth: list[str], **_: object) -> list[float]:
        return [
            float(score_fn(text(p), text(c), g)["score"])
            for p, c, g in zip(prompts, completions, ground_truth, strict=True)
        ]

    ends: list[float] = []

    class StepClock(TrainerCallback):
        def on_step_end(self, *_: object, **__: object) -> None:
            ends.append(time.perf_counter())

    samples = args.prompts * args.n
    config = GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="vs-trl-"),
        per_device_train_batch_size=samples,
        gradient_accumulation_steps=1,
        num_generations=args.n,
        max_completion_length=args.max_new_tokens,
        learning_rate=args.lr,
        beta=0.0,
        temperature=1.0,
        max_steps=args.steps,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=args.device == "cpu",
        bf16=args.device == "cuda",  # fp32 weights, bf16 autocast: as Tandem computes on CUDA
        seed=0,
        shuffle_dataset=False,
        disable_tqdm=True,
    )
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype="float32")
    peft_config = None
    if args.lora:
        from peft import LoraConfig

        peft_config = LoraConfig(
            r=LORA["rank"], lora_alpha=LORA["alpha"], target_modules="all-linear", task_type="CAUSAL_LM"
        )
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=reward,
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[StepClock()],
        peft_config=peft_config,
    )
    trainer.train()
    return step_intervals(ends)


# ---- the Tandem side ---------------------------------------------------------------------------


# Tandem's per-step metrics whose medians a run reports beside its step times: every phase time
# (timing_s/*) and the share of rows without advantage.
ZERO_ROWS = "critic/advantages/zero_rows"
LENGTHS = ("prompt_length/mean", "response_length/mean")
TRANSFER = "weight_sync/seconds"  # the weight transfer alone, inside the sync phase


def run_tandem(args: argparse.Namespace) -> tuple[list[float], dict[str, float]]:
    import ray

    from bench import mm_probes
    from bench.flops import machine_peak, model_shape, phase_utilisation, sustained_matmul_flops
    from controller.sink import JsonlSink
    from controller.spec import JobSpec
    from controller.trainer import Trainer
    from engines.threads import physical_cores

    class ClockSink(JsonlSink):
        """Each step's end, its metrics, and (with `peak_s`) a loop of products right after it, run
        in this process while the job's workers wait for the next step (the trainer calls `metrics`
        between steps)."""

        def __init__(self, folder: Path, peak_s: float) -> None:
            super().__init__(folder)
            self.peak_s = peak_s
            self.ends: list[float] = []
            self.values: list[dict[str, float]] = []
            self.loops: list[float] = []  # FLOP/s of the loop after each step
            self.paused: list[float] = []  # its seconds
            self.wall_ends: list[float] = []  # time.time() at each step's end, against the probes'

        def metrics(self, step: int, values: dict[str, float]) -> None:
            self.ends.append(time.perf_counter())
            self.wall_ends.append(time.time())
            self.values.append(values)
            super().metrics(step, values)
            if self.peak_s > 0:
                start = time.perf_counter()
                self.loops.append(sustained_matmul_flops(physical_cores(), self.peak_s))
                self.paused.append(time.perf_counter() - start)

    # The job's rank computes on the machine's physical cores (engines/threads.py): the peak at those,
    # before and after the job (on a shared host one burst read 184-322 GFLOP/s minutes apart); the
    # utilisation is against the higher, the attainable peak.
    # Beside it, a 5 s loop of products before and after: what the cores give over seconds.
    before = machine_peak(physical_cores())
    sustained = [sustained_matmul_flops(physical_cores(), 5.0)]
    spec = JobSpec.model_validate(tandem_spec(args))
    # The job's folder holds its final checkpoint (1.7 GB at SmolLM2-135M: weights and AdamW state):
    # removed with the run (TRL's side saves nothing: save_strategy "no").
    workdir = Path(tempfile.mkdtemp(prefix="vs-tandem-"))
    runtime_env: dict = {"env_vars": {"PYTHONPATH": str(ROOT)}}
    if args.probe_every:
        (workdir / "probes").mkdir()
        runtime_env["env_vars"][mm_probes.ENV] = f"{args.probe_every}:{workdir / 'probes'}"
        runtime_env["worker_process_setup_hook"] = "bench.mm_probes.install"
    ray.init(include_dashboard=False, logging_level="error", runtime_env=runtime_env)
    try:
        sink = ClockSink(workdir, args.peak_between_steps)
        Trainer(spec, workdir, sink, name="vs-trl").run()
        probes = mm_probes.read_probes(workdir / "probes") if args.probe_every else []
    finally:
        ray.shutdown()
        shutil.rmtree(workdir, ignore_errors=True)
    probed = probes_per_step(probes, sink.wall_ends) if args.probe_every else []
    if args.probe_every and not any(probed[1:]):
        raise RuntimeError("--probe-every: no probe ran in the ranks (the setup hook did not take)")
    for values, step in zip(sink.values, probed, strict=False):  # net of the probes' seconds
        if "timing_s/update_actor" in values:
            values["timing_s/update_actor"] -= sum(p["probe_s"] for p in step)
    sustained.append(sustained_matmul_flops(physical_cores(), 5.0))
    after = machine_peak(physical_cores())
    peak = max(before, after, key=lambda p: p["matmul_flops"])
    later = sink.values[1:]  # the first step's include warm-up, as its time does
    medians = phase_medians(later)
    shape = model_shape(args.model_dir)
    medians.update(
        phase_utilisation(medians, shape, peak, args.prompts, args.n, args.max_new_tokens, lora=args.lora)
    )
    medians["peak_matmul_gflops_before_after"] = [round(p["matmul_flops"] / 1e9, 1) for p in (before, after)]
    medians["sustained_matmul_gflops_before_after"] = [round(f / 1e9, 1) for f in sustained]
    per_step = [
        phase_utilisation(v, shape, peak, args.prompts, args.n, args.max_new_tokens, lora=args.lora)
        for v in later
        if "timing_s/update_actor" in v
    ]
    if per_step:
        medians["update_gflops_per_step"] = [p["update_gflops"] for p in per_step]
        step_median = statistics.median(medians["update_gflops_per_step"])
        medians["update_mfu_sustained"] = round(step_median * 2e9 / sum(sustained), 4)
    if per_step and len(per_step) == len(later) and len(sink.loops) == len(sink.values):
        # values[j] (j >= 1) ran between the loops after steps j-1 and j.
        beside = [(sink.loops[j - 1] + sink.loops[j]) / 2 for j in range(1, len(sink.values))]
        rated = [p["update_gflops"] * 1e9 / b for p, b in zip(per_step, beside, strict=True)]
        medians["sustained_matmul_gflops_between_steps"] = [round(f / 1e9, 1) for f in sink.loops]
        medians["update_mfu_between_steps"] = [round(r, 4) for r in rated]
        medians["update_mfu_between_steps_median"] = round(statistics.median(rated), 4)
    probed_rated, peaks = [], []
    for values, step in zip(later, probed[1:], strict=False):  # steps with an update and probes in it
        if "timing_s/update_actor" in values and step:
            p = phase_utilisation(values, shape, peak, args.prompts, args.n, args.max_new_tokens, args.lora)
            peaks.append(statistics.median(probe["gflops"] for probe in step))
            probed_rated.append(p["update_gflops"] / peaks[-1])
    if probed_rated:
        medians["probe_gflops_per_step"] = [round(g, 1) for g in peaks]
        medians["probes_per_step"] = [len(step) for step in probed[1:]]
        medians["update_mfu_probed"] = [round(r, 4) for r in probed_rated]
        medians["update_mfu_probed_median"] = round(statistics.median(probed_rated), 4)
    # the loop after each step and the probes inside the next are out of its time
    paused = [
        loop + (sum(p["probe_s"] for p in probed[j + 1]) if j + 1 < len(probed) else 0.0)
        for j, loop in enumerate(sink.paused or [0.0] * len(sink.ends))
    ]
    return step_intervals(sink.ends, paused), medians


def tandem_spec(args: argparse.Namespace) -> dict:
    """The Tandem job: the same model, data, reward and settings as the TRL side, plus --tandem-set."""
    spec = {
        "method": "grpo",
        "model": {"path": args.model_dir, **({"lora": LORA} if args.lora else {})},
        "data": {"train_path": args.train, "builtin_task": None, "shuffle": False},
        "reward": {"function": REWARDS[args.reward]},
        "trainer": {"total_steps": args.steps, "prompts_per_step": args.prompts, "val_every": 0},
        "rollout": {"n": args.n, "max_new_tokens": args.max_new_tokens, "temperature": 1.0},
        "optim": {"lr": args.lr},
        "checkpoint": {"every": 0, "export_hf": False},
    }
    for item in args.tandem_set:  # a lever to measure, e.g. resources.workers=2 (not the defaults)
        path, value = item.split("=", 1)
        *parents, leaf = path.split(".")
        section = spec
        for key in parents:
            section = section.setdefault(key, {})
        try:
            section[leaf] = json.loads(value)
        except ValueError:
            section[leaf] = value  # a plain string
    return spec


def phase_medians(later: list[dict[str, float]]) -> dict[str, float]:
    """Medians over the timed steps of every phase time, the weight transfer, the zero-advantage share
    and the lengths."""
    wanted = (ZERO_ROWS, *LENGTHS, TRANSFER)
    keys = sorted(k for k in (later[0] if later else {}) if k.startswith("timing_s/") or k in wanted)
    return {k: round(statistics.median(v[k] for v in later), 4) for k in keys if all(k in v for v in later)}


def run_tandem_served(args: argparse.Namespace) -> tuple[list[float], dict]:
    """The Tandem side as users run it: `tandem serve`, the job submitted to it and followed
    (bench/served_job.py). Per phase: generation tokens/s and its share of the bandwidth-and-compute
    floor, the sync phase against its own transfer, the update's FLOP/s against the device's product
    rate, measured in this process before and after the job."""
    from bench.flops import cuda_peak, machine_peak, model_shape, phase_utilisation
    from bench.served_job import run_served_job
    from engines.threads import physical_cores

    measure = cuda_peak if args.device == "cuda" else lambda: machine_peak(physical_cores())
    before = measure()
    work = Path(tempfile.mkdtemp(prefix="vs-served-"))
    allow = sorted({Path(args.model_dir).parent, Path(args.train).parent, ROOT / "bench"})
    try:
        run = run_served_job(tandem_spec(args), work / "home", allow, timeout_s=args.job_timeout)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    peak = max(before, measure(), key=lambda p: p["matmul_flops"])
    rows = run["metrics"]
    medians = phase_medians([r["values"] for r in rows[1:]])
    shape = model_shape(args.model_dir)
    if args.device == "cuda":  # decode reads bf16 weights there
        shape["weight_bytes"] //= 2
    medians.update(phase_utilisation(medians, shape, peak, args.prompts, args.n, args.max_new_tokens))
    gen_s, sync_s = medians.get("timing_s/gen"), medians.get("timing_s/sync")
    if gen_s:
        tokens = args.prompts * args.n * medians.get("response_length/mean", args.max_new_tokens)
        medians["gen_tokens_per_s"] = round(tokens / gen_s, 1)
    if sync_s and medians.get(TRANSFER):
        medians["sync_over_transfer"] = round(sync_s / medians[TRANSFER], 2)
    building = [e for e in run["events"] if e.get("kind") == "building"]
    medians["rollout_backend"] = building[0].get("data", {}).get("rollout_backend") if building else None
    return step_intervals([r["time"] for r in rows]), medians


def probes_per_step(probes: list[dict], wall_ends: list[float]) -> list[list[dict]]:
    """The probes inside each step: step j's ran after step j - 1 ended (the first's, before the
    first end). The loops between steps run in the driver, which is not probed."""
    steps, previous = [], float("-inf")
    for end in wall_ends:
        steps.append([p for p in probes if previous < p["time"] <= end])
        previous = end
    return steps


# ---- the driver --------------------------------------------------------------------------------


def run_side(side: str, args: argparse.Namespace, model_dir: Path, train: Path, max_new_tokens: int) -> dict:
    command = (
        [
            sys.executable,
            __file__,
            "--side",
            side,
            "--model-dir",
            str(model_dir),
            "--train",
            str(train),
            "--max-new-tokens",
            str(max_new_tokens),
            "--steps",
            str(args.steps),
            "--n",
            str(args.n),
            "--prompts",
            str(args.prompts),
            "--lr",
            str(args.lr),
            "--reward",
            args.reward,
            "--peak-between-steps",
            str(args.peak_between_steps),
            "--probe-every",
            str(args.probe_every),
            "--device",
            args.device,
            "--job-timeout",
            str(args.job_timeout),
        ]
        + [f"--tandem-set={item}" for item in args.tandem_set]
        + (["--lora"] if args.lora else [])
    )
    command += ["--served"] if args.served else []  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TOKENIZERS_PARALLELISM": "false"}
    done = subprocess.run(command, capture_output=True, text=True, env=env, check=False)
    lines = [line for line in done.stdout.splitlines() if line.startswith('{"side"')]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"{side} run failed (exit {done.returncode}):\n{done.stderr[-4000:]}")
    return json.loads(lines[-1])


def token_counts(text: str) -> list[int]:
    return [int(t) for t in text.split(",")]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shapes", default="small,large", help=f"comma-separated, from {sorted(SHAPES)}")
    parser.add_argument("--model", help="one shape on this built-in model instead of --shapes")
    parser.add_argument(
        "--new-tokens", type=token_counts, default=[16], help="max new tokens with --model (comma-separated)"
    )
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where both sides train")
    parser.add_argument(
        "--served",
        action="store_true",
        help="Tandem through `tandem serve` and a submitted job (always on CUDA)",
    )
    parser.add_argument("--job-timeout", type=float, default=1800.0, help="seconds a served job may take")
    parser.add_argument("--lora", action="store_true", help="LoRA on both sides (same rank, targets)")
    parser.add_argument("--steps", type=int, default=6, help="GRPO steps per run (the first is dropped)")
    parser.add_argument("--rounds", type=int, default=2, help="alternating TRL/Tandem pairs per shape")
    parser.add_argument("--n", type=int, default=8, help="samples per prompt (group size)")
    parser.add_argument("--prompts", type=int, default=16, help="prompts per step")
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--reward", choices=sorted(REWARDS), default="arithmetic", help="see above")
    parser.add_argument(
        "--peak-between-steps", type=float, default=2.0,
        help="seconds of matrix products after every Tandem step, to rate its update against (0: none)",
    )  # fmt: skip
    parser.add_argument(
        "--probe-every", type=int, default=0,
        help="a 2048^3 product after every K-th product of the Tandem ranks' training (0: none)",
    )  # fmt: skip
    parser.add_argument(
        "--tandem-set",
        action="append",
        default=[],
        metavar="KEY.PATH=VALUE",
        help="change the Tandem job's spec (a lever to measure; the goal is about the defaults)",
    )
    parser.add_argument("--side", choices=("trl", "tandem"), help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    parser.add_argument("--train", help=argparse.SUPPRESS)
    parser.add_argument("--max-new-tokens", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.served = args.served or args.device == "cuda"
    if args.served and (args.probe_every or args.lora):
        parser.error("--probe-every and --lora run with the in-process Tandem side only (not --served/cuda)")

    if args.side:  # a child process: one run of one side
        tandem = run_tandem_served if args.served else run_tandem
        steps, medians = (run_trl(args), {}) if args.side == "trl" else tandem(args)
        line = {"side": args.side, "step_s": [round(s, 4) for s in steps], "medians": medians}
        print(json.dumps(line), flush=True)
        return

    from controller.models import builtin_model_path
    from engines.tiny_models import BUILTIN_MODELS, build_builtin_model

    work = Path(tempfile.mkdtemp(prefix="vs-trl-bench-"))
    train = write_prompts(work, args.steps * args.prompts)
    shapes = {f"{args.model}@{t}": (args.model, t) for t in args.new_tokens} if args.model else SHAPES
    for shape in list(shapes) if args.model else args.shapes.split(","):
        model_name, max_new_tokens = shapes[shape]
        model_dir = (
            build_builtin_model(model_name, work / "models")  # fresh random weights, as before
            if model_name in BUILTIN_MODELS
            else builtin_model_path(model_name)  # a packaged real model, built once under TANDEM_HOME
        )
        times: dict[str, list[float]] = {"trl": [], "tandem": []}
        loads = []
        for round_index in range(args.rounds):
            for side in ("trl", "tandem"):
                run = run_side(side, args, model_dir, train, max_new_tokens)
                times[side] += run["step_s"]
                loads.append(os.getloadavg()[0])
                line = {"bench": "vs_trl", "shape": shape, "round": round_index, "side": side}
                line.update(step_s_median=round(statistics.median(run["step_s"]), 4), step_s=run["step_s"])
                line.update(run["medians"])
                print(json.dumps(line), flush=True)
        trl, tandem = statistics.median(times["trl"]), statistics.median(times["tandem"])
        summary = {
            "bench": "vs_trl",
            "shape": shape,
            "model": model_name,
            "params": parameter_count(model_dir),
            "prompts": args.prompts,
            "n": args.n,
            "max_new_tokens": max_new_tokens,
            "reward": args.reward,
            "device": args.device,
            "served": args.served,
            "lora": LORA if args.lora else None,
            "tandem_set": args.tandem_set,
            "steps_timed_per_side": len(times["trl"]),
            "trl_s_per_step": round(trl, 4),
            "tandem_s_per_step": round(tandem, 4),
            "ratio_tandem_vs_trl": round(tandem / trl, 3),
            "load_avg_1m": [round(x, 2) for x in loads],
            "commit": git_commit(),
        }
        print(json.dumps(summary), flush=True)


def git_commit() -> str:
    done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT)
    return done.stdout.strip()


def parameter_count(model_dir: Path) -> int:
    from safetensors import safe_open

    with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
        return sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())


if __name__ == "__main__":
    main()
