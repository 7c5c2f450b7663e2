"""The Tandem side of bench/vs_trl.py: the same model, prompts and settings as TRL's, as a job with
the defaults a user gets, trained in this process on a local Ray (`run_tandem`) or submitted to a
`tandem serve` (`run_tandem_served`). Returns the seconds of each step after the first and the
medians of the job's phase metrics, with the update and generation rated against what the machine
did in the same run (bench/flops.py, bench/mm_probes.py)."""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from bench.harness import ROOT
from bench.vs_trl_task import LORA, REWARDS, step_intervals
from controller.sink import JsonlSink

ZERO_ROWS = "critic/advantages/zero_rows"
LENGTHS = ("prompt_length/mean", "response_length/mean")
TRANSFER = "weight_sync/seconds"  # the weight transfer alone, inside the sync phase
UPDATE = "timing_s/update_actor"


class ClockSink(JsonlSink):
    """Each step's end, its metrics, and (with `peak_s`) a loop of products right after it, run in
    this process while the job's workers wait for the next step (the trainer calls `metrics` between
    steps)."""

    def __init__(self, folder: Path, peak_s: float) -> None:
        super().__init__(folder)
        self.peak_s = peak_s
        self.ends: list[float] = []
        self.values: list[dict[str, float]] = []
        self.loops: list[float] = []  # FLOP/s of the loop after each step
        self.paused: list[float] = []  # its seconds
        self.wall_ends: list[float] = []  # time.time() at each step's end, against the probes'

    def metrics(self, step: int, values: dict[str, float]) -> None:
        from bench.flops import sustained_matmul_flops
        from engines.threads import physical_cores

        self.ends.append(time.perf_counter())
        self.wall_ends.append(time.time())
        self.values.append(values)
        super().metrics(step, values)
        if self.peak_s > 0:
            start = time.perf_counter()
            self.loops.append(sustained_matmul_flops(physical_cores(), self.peak_s))
            self.paused.append(time.perf_counter() - start)


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


def probes_per_step(probes: list[dict], wall_ends: list[float]) -> list[list[dict]]:
    """The probes inside each step: step j's ran after step j - 1 ended (the first's, before the
    first end). The loops between steps run in the driver, which is not probed."""
    steps, previous = [], float("-inf")
    for end in wall_ends:
        steps.append([p for p in probes if previous < p["time"] <= end])
        previous = end
    return steps


def train_clocked(args: argparse.Namespace) -> tuple[ClockSink, list[list[dict]]]:
    """The job on a local Ray, its steps clocked, and (with --probe-every) the probes of each step."""
    import ray

    from bench import mm_probes
    from controller.trainer import Trainer
    from schema.job import JobSpec

    spec = JobSpec.model_validate(tandem_spec(args))
    # The job's folder holds its final checkpoint (1.7 GB at SmolLM2-135M): removed with the run.
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
        if UPDATE in values:
            values[UPDATE] -= sum(p["probe_s"] for p in step)
    return sink, probed


def rate_between_steps(per_step: list[dict], loops: list[float]) -> dict:
    """Each timed step's update against the mean of the loops on its two sides."""
    beside = [(loops[j - 1] + loops[j]) / 2 for j in range(1, len(loops))]  # step j ran between them
    rated = [p["update_gflops"] * 1e9 / b for p, b in zip(per_step, beside, strict=True)]
    return {
        "sustained_matmul_gflops_between_steps": [round(f / 1e9, 1) for f in loops],
        "update_mfu_between_steps": [round(r, 4) for r in rated],
        "update_mfu_between_steps_median": round(statistics.median(rated), 4),
    }


def rate_against_probes(later: list[dict], probed: list[list[dict]], rate) -> dict:
    """Each step's update against the median of the probes that ran inside it."""
    rated, peaks = [], []
    for values, step in zip(later, probed[1:], strict=False):  # steps with an update and probes in it
        if UPDATE in values and step:
            peaks.append(statistics.median(probe["gflops"] for probe in step))
            rated.append(rate(values)["update_gflops"] / peaks[-1])
    if not rated:
        return {}
    return {
        "probe_gflops_per_step": [round(g, 1) for g in peaks],
        "probes_per_step": [len(step) for step in probed[1:]],
        "update_mfu_probed": [round(r, 4) for r in rated],
        "update_mfu_probed_median": round(statistics.median(rated), 4),
    }


def run_tandem(args: argparse.Namespace) -> tuple[list[float], dict[str, float]]:
    from bench.flops import machine_peak, model_shape, phase_utilisation, sustained_matmul_flops
    from engines.threads import physical_cores

    # The rank computes on the physical cores (engines/threads.py): a burst peak at those before and
    # after the job (on a shared host they part by up to 1.7x; the higher is the attainable one), and
    # a 5 s loop before and after, what the cores give over seconds.
    before = machine_peak(physical_cores())
    sustained = [sustained_matmul_flops(physical_cores(), 5.0)]
    sink, probed = train_clocked(args)
    sustained.append(sustained_matmul_flops(physical_cores(), 5.0))
    after = machine_peak(physical_cores())
    peak = max(before, after, key=lambda p: p["matmul_flops"])
    shape = model_shape(args.model_dir)

    def rate(values: dict) -> dict:
        return phase_utilisation(
            values, shape, peak, args.prompts, args.n, args.max_new_tokens, lora=args.lora
        )

    later = sink.values[1:]  # the first step's include warm-up, as its time does
    medians = phase_medians(later)
    medians.update(rate(medians))
    medians["peak_matmul_gflops_before_after"] = [round(p["matmul_flops"] / 1e9, 1) for p in (before, after)]
    medians["sustained_matmul_gflops_before_after"] = [round(f / 1e9, 1) for f in sustained]
    per_step = [rate(v) for v in later if UPDATE in v]
    if per_step:
        medians["update_gflops_per_step"] = [p["update_gflops"] for p in per_step]
        step_median = statistics.median(medians["update_gflops_per_step"])
        medians["update_mfu_sustained"] = round(step_median * 2e9 / sum(sustained), 4)
    if per_step and len(per_step) == len(later) and len(sink.loops) == len(sink.values):
        medians.update(rate_between_steps(per_step, sink.loops))
    medians.update(rate_against_probes(later, probed, rate))
    # the loop after each step and the probes inside the next are out of its time
    paused = [
        loop + (sum(p["probe_s"] for p in probed[j + 1]) if j + 1 < len(probed) else 0.0)
        for j, loop in enumerate(sink.paused or [0.0] * len(sink.ends))
    ]
    return step_intervals(sink.ends, paused), medians


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
    unsandboxed = shutil.which("bwrap") is None  # the reward is this repository's code
    allow = sorted({Path(args.model_dir).parent, Path(args.train).parent, ROOT / "bench"})
    try:
        run = run_served_job(tandem_spec(args), work / "home", allow, args.job_timeout, unsandboxed)
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
    medians["user_code_sandboxed"] = not unsandboxed
    medians["rollout_backend"] = building[0].get("data", {}).get("rollout_backend") if building else None
    return step_intervals([r["time"] for r in rows]), medians
