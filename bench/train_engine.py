"""Training throughput: FSDPEngine against a plain transformers forward/backward loop.

Every configuration trains on the same batches (left-padded prompts, right-padded responses of
random real lengths, as in engines/training/base.py) with the same token-mean policy-gradient loss, the same
micro-batch size, AdamW and grad-norm clipping at 1.0. The baseline is the loop anyone would write:
a padded forward of an unsharded `AutoModelForCausalLM`, log_softmax + gather on the response
columns, backward per micro-batch, one optimizer step. The engine runs at world size 1 (fixed
micro-batches, then dynamic batching under a token budget) and at world size 2 (two gloo processes,
half the batch each). Each configuration runs in its own processes, so its peak memory is its own,
and the configurations take turns step by step (see `Turns`), so a neighbour's load on shared cores
falls on all of them alike.

Throughput counts real (non-pad) tokens. Warm-up steps are excluded; a figure is the median of the
timed steps. One JSON line per configuration, each with its ratio against the baseline measured in
the same run (and world size 2 against world size 1); progress goes to stderr.

    .venv/bin/python bench/train_engine.py [--model qwen2-20m] [--device cpu|cuda] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.multiprocessing as mp
from tensordict import TensorDict

# The repository root, for `engines` and `bench` where the project is not installed; spawned workers
# re-run this.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.harness import free_port  # noqa: E402
from bench.train_loops import (  # noqa: E402
    Settings,
    Turns,
    baseline_step_fn,
    engine_step_fn,
    make_batches,
    timed_steps,
)

MFU_NOTE = (
    "6 * params * real tokens / s / peak: embedding parameters counted, attention FLOPs ignored, "
    "padding the baseline computes on is not counted"
)


@dataclass(frozen=True)
class Job:
    """One configuration: the baseline, or the engine at a world size with a micro-batch split."""

    name: str
    engine: bool
    world: int
    threads_per_rank: int
    micro_batch: dict = field(default_factory=dict)


# ---- worker processes ---------------------------------------------------------------------------


def peak_memory_mib(device: torch.device) -> tuple[float, str]:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20, "torch.cuda.max_memory_allocated"
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, "ru_maxrss"  # KiB on Linux


def worker(
    job: Job, slot: int, rank: int, port: int, settings: Settings, vocab: int, turns: Turns, out_dir: str
) -> None:
    """One process of a configuration: train in its turns, then write its step times and peak memory."""
    torch.set_num_threads(job.threads_per_rank)
    if settings.device == "cuda":
        torch.backends.cuda.enable_cudnn_sdp(settings.cudnn_sdpa)
    env = {"RANK": rank, "LOCAL_RANK": rank, "WORLD_SIZE": job.world, "MASTER_ADDR": "127.0.0.1"}
    os.environ.update({k: str(v) for k, v in {**env, "MASTER_PORT": port}.items()})
    share = settings.batch // job.world
    batches = [b[rank * share : (rank + 1) * share] for b in make_batches(settings, vocab)]
    device = torch.device(settings.device, rank) if settings.device == "cuda" else torch.device("cpu")

    @contextmanager
    def turn(step: int) -> Iterator[None]:
        turns.wait(step, slot)
        yield
        if rank == 0:  # after sync(): every rank of this configuration has finished the step
            turns.done()
            print(f"  {job.name} step {step + 1}/{len(batches)}", file=sys.stderr, flush=True)

    if job.engine:
        import torch.distributed as dist

        step, engine = engine_step_fn(settings, job.micro_batch)

        def sync() -> None:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            dist.barrier()  # the ranks start a step together, so a step's time is the slowest rank's

        with engine.train_mode():
            seconds, cpu = timed_steps(step, batches, sync, turn)
        dist.destroy_process_group()
    else:
        step = baseline_step_fn(settings, device)

        def sync() -> None:
            if device.type == "cuda":
                torch.cuda.synchronize(device)

        seconds, cpu = timed_steps(step, batches, sync, turn)
    peak, kind = peak_memory_mib(device)
    result = {"seconds": seconds[settings.warmup :], "cpu_seconds": cpu[settings.warmup :]}
    result |= {"peak_mem_mib": peak, "peak_mem_kind": kind}
    Path(out_dir, f"{job.name}-rank{rank}.json").write_text(json.dumps(result))


def run_jobs(jobs: list[Job], settings: Settings, vocab: int, out_dir: str) -> dict[str, list[dict]]:
    """All configurations at once, taking turns; each rank's results by configuration name."""
    ctx = mp.get_context("spawn")
    turns = Turns(ctx, len(jobs))
    procs = []
    for slot, job in enumerate(jobs):
        port = free_port()
        for rank in range(job.world):
            args = (job, slot, rank, port, settings, vocab, turns, out_dir)
            procs.append((f"{job.name} rank {rank}", ctx.Process(target=worker, args=args, daemon=True)))
    for _, proc in procs:
        proc.start()
    while any(proc.is_alive() for _, proc in procs):
        failed = [(name, proc.exitcode) for name, proc in procs if proc.exitcode not in (None, 0)]
        if failed:
            for _, proc in procs:
                proc.terminate()
            raise RuntimeError(f"benchmark process {failed[0][0]} exited with code {failed[0][1]}")
        time.sleep(0.2)
    return {
        job.name: [
            json.loads(Path(out_dir, f"{job.name}-rank{r}.json").read_text()) for r in range(job.world)
        ]
        for job in jobs
    }


# ---- report -------------------------------------------------------------------------------------


def count_params(model_dir: str) -> int:
    from safetensors import safe_open

    total = 0
    for file in Path(model_dir).glob("*.safetensors"):
        with safe_open(str(file), "pt") as f:
            for key in f.keys():
                total += int(torch.Size(f.get_slice(key).get_shape()).numel())
    return total


def micro_batches_per_step(job: Job, settings: Settings, batches: list[TensorDict]) -> float | None:
    """Mean micro-batches a rank runs per timed step (rank 0's share; every rank runs as many)."""
    from engines.training.microbatch import dynamic_micro_batches, fixed_micro_batches

    if job.micro_batch.get("auto"):
        return (
            None  # the engine's own budget (engines/training/microbatch.auto_token_budget): not replayed here
        )
    share = settings.batch // job.world
    counts = []
    for batch in batches:
        lengths = batch["attention_mask"][:share].sum(1).tolist()
        budget = job.micro_batch.get("max_tokens_per_micro_batch")
        plan = (
            dynamic_micro_batches(lengths, budget)
            if budget
            else fixed_micro_batches(len(lengths), settings.micro_batch_size)
        )
        counts.append(len(plan))
    return round(statistics.mean(counts), 2)


def report(
    job: Job,
    ranks: list[dict],
    settings: Settings,
    batches: list[TensorDict],
    params: int,
    peak_tflops: float,
) -> dict:
    """The JSON line of one configuration; a step's time is the slowest rank's."""
    tokens = [int(b["attention_mask"].sum()) for b in batches]
    seconds = [max(r["seconds"][i] for r in ranks) for i in range(settings.iters)]
    rates = [t / s for t, s in zip(tokens, seconds, strict=True)]
    line = {
        "bench": "train_engine",
        "config": job.name,
        "model": settings.model,
        "params": params,
        "device": settings.device,
        "dtype": "bfloat16" if settings.device == "cuda" else "float32",
        "world_size": job.world,
        "threads_per_rank": job.threads_per_rank,
        "batch": settings.batch,
        "seq_len": settings.prompt_len + settings.response_len,
        "real_tokens_per_step": round(statistics.mean(tokens), 1),
        "micro_batch": job.micro_batch or {"micro_batch_size": settings.micro_batch_size},
        "micro_batches_per_rank_step": micro_batches_per_step(job, settings, batches),
        "warmup": settings.warmup,
        "iters": settings.iters,
        "step_s_median": round(statistics.median(seconds), 4),
        "tokens_per_s": round(statistics.median(rates), 1),
        # The fastest step: on shared cores the least disturbed by neighbours.
        "tokens_per_s_best": round(max(rates), 1),
        # CPU seconds of all ranks over wall seconds * threads: 1.0 = every thread busy throughout.
        "cpu_busy": round(
            sum(sum(r["cpu_seconds"]) for r in ranks) / (sum(seconds) * job.threads_per_rank * job.world), 2
        ),
        "peak_mem_mib": round(max(r["peak_mem_mib"] for r in ranks), 1),
        "peak_mem_kind": ranks[0]["peak_mem_kind"] + (" (max over ranks)" if job.world > 1 else ""),
        "loadavg_1m_at_end": round(os.getloadavg()[0], 2),
    }
    if not job.engine:
        line["baseline"] = "transformers padded forward, sdpa" + (
            ", fp32 weights + bf16 autocast" if settings.device == "cuda" else ", fp32"
        )
    if settings.device == "cuda":
        line["mfu"] = round(6 * params * line["tokens_per_s"] / (peak_tflops * 1e12), 4)
        line["peak_tflops"] = peak_tflops
        line["mfu_note"] = MFU_NOTE
        line["cudnn_sdpa"] = settings.cudnn_sdpa
    return line


def ratios(line: dict, reference: dict, name: str) -> dict[str, float]:
    """Throughput of `line` over `reference`: of the medians, and of the best steps."""
    return {
        f"ratio_vs_{name}": round(line["tokens_per_s"] / reference["tokens_per_s"], 3),
        f"ratio_vs_{name}_best": round(line["tokens_per_s_best"] / reference["tokens_per_s_best"], 3),
    }


def emit(line: dict) -> None:
    print(json.dumps(line), flush=True)


def cli() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model",
        default=None,
        help="built-in model or model folder (default qwen2-20m; qwen2-1m with --quick)",
    )
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument(
        "--batch", type=int, default=None, help="sequences per step (default 8 on CPU, 16 on CUDA)"
    )
    parser.add_argument("--prompt-len", type=int, default=None, help="padded prompt width (default 64)")
    parser.add_argument("--response-len", type=int, default=None, help="padded response width (default 192)")
    parser.add_argument(
        "--micro-batch-size", type=int, default=None, help="default 4 (batch / 2 with --quick)"
    )
    parser.add_argument("--max-tokens", type=int, default=None, help="dynamic budget (default mb * seq_len)")
    parser.add_argument("--iters", type=int, default=None, help="timed steps (default 3 on CPU, 5 on CUDA)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed steps first (default 1; 2 on CUDA)")
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch threads at world size 1 (default: cores); world size 2 gets half per rank",
    )
    parser.add_argument("--peak-tflops", type=float, default=989.0, help="bf16 dense peak (H100 SXM: 989)")
    parser.add_argument(
        "--no-cudnn-sdpa",
        action="store_true",
        help="CUDA: keep SDPA off its cuDNN backend, which builds a plan per new sequence length",
    )
    parser.add_argument(
        "--quick", action="store_true", help="smoke run: tiny shapes, one timed step (start-up dominates)"
    )
    return parser


def parse_settings(argv: list[str] | None, model_dir_root: str) -> tuple[Settings, float]:
    parser = cli()
    args = parser.parse_args(argv)
    quick = args.quick

    def pick(value: int | None, normal: int, small: int) -> int:
        return value if value is not None else (small if quick else normal)

    cuda = args.device == "cuda"
    batch = pick(args.batch, 16 if cuda else 8, 4)
    prompt_len, response_len = pick(args.prompt_len, 64, 16), pick(args.response_len, 192, 48)
    micro = pick(args.micro_batch_size, 4, 2)
    model = args.model or ("qwen2-1m" if quick else "qwen2-20m")
    if batch % 2 or micro > batch:
        parser.error(f"--batch {batch} must be even (world size 2 splits it) and at least --micro-batch-size")
    from engines.models.tiny_models import builtin_or_folder

    settings = Settings(
        model=Path(model).name,
        model_dir=str(builtin_or_folder(model, model_dir_root)),
        device=args.device,
        batch=batch,
        prompt_len=prompt_len,
        response_len=response_len,
        micro_batch_size=micro,
        max_tokens=args.max_tokens or micro * (prompt_len + response_len),
        iters=pick(args.iters, 5 if cuda else 3, 1),
        warmup=pick(args.warmup, 2 if cuda else 1, 1),
        threads=args.threads or os.cpu_count() or 1,
        cudnn_sdpa=not args.no_cudnn_sdpa,
    )
    return settings, args.peak_tflops


def main(argv: list[str] | None = None) -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    with tempfile.TemporaryDirectory() as root:
        settings, peak_tflops = parse_settings(argv, root)
        from transformers import AutoConfig

        vocab = AutoConfig.from_pretrained(settings.model_dir).vocab_size
        params = count_params(settings.model_dir)
        timed = make_batches(settings, vocab)[settings.warmup :]
        print(f"settings: {json.dumps(asdict(settings))}", file=sys.stderr)
        fixed = {"micro_batch_size": settings.micro_batch_size}
        t = settings.threads
        jobs = [
            Job("baseline_hf", engine=False, world=1, threads_per_rank=t),
            Job("engine_ws1", engine=True, world=1, threads_per_rank=t, micro_batch=fixed),
            Job(
                "engine_ws1_dynamic",
                engine=True,
                world=1,
                threads_per_rank=t,
                micro_batch={"max_tokens_per_micro_batch": settings.max_tokens},
            ),
            # What a job gets: no micro-batch setting, the engine's token budget from the model's size.
            Job("engine_ws1_auto", engine=True, world=1, threads_per_rank=t, micro_batch={"auto": True}),
            # The ranks share the cores: half the threads each, so both sizes use the same cores.
            Job("engine_ws2", engine=True, world=2, threads_per_rank=max(1, t // 2), micro_batch=fixed),
        ]
        if settings.device == "cuda" and torch.cuda.device_count() < 2:
            reason = f"world size 2 needs 2 GPUs, {torch.cuda.device_count()} visible"
            emit({"bench": "train_engine", "config": "engine_ws2", "skipped": reason})
            jobs = [job for job in jobs if job.world == 1]
        print(f"{len(jobs)} configurations, taking turns step by step", file=sys.stderr)
        results = run_jobs(jobs, settings, vocab, root)
        lines: dict[str, dict] = {}
        for job in jobs:
            line = report(job, results[job.name], settings, timed, params, peak_tflops)
            if job.engine:
                line |= ratios(line, lines["baseline_hf"], "baseline")
            if job.world > 1:
                line |= ratios(line, lines["engine_ws1"], "ws1")
            lines[job.name] = line
            emit(line)


if __name__ == "__main__":
    main()
