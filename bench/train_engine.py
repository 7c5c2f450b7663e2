"""Training throughput: FSDPEngine against a plain transformers forward/backward loop.

Every configuration trains on the same batches (left-padded prompts, right-padded responses of
random real lengths, as in engines/base.py) with the same token-mean policy-gradient loss, the same
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
import socket
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import asdict, dataclass, field
from multiprocessing.context import BaseContext
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.multiprocessing as mp
from tensordict import TensorDict

if TYPE_CHECKING:
    from engines.base import GlobalCounts
    from engines.fsdp.engine import FSDPEngine

# The repository root, for `engines` where the project is not installed; spawned workers re-run this.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

MFU_NOTE = (
    "6 * params * real tokens / s / peak: embedding parameters counted, attention FLOPs ignored, "
    "padding the baseline computes on is not counted"
)


@dataclass(frozen=True)
class Settings:
    """One benchmark run, resolved from the command line; handed to every worker process."""

    model: str
    model_dir: str
    device: str
    batch: int
    prompt_len: int
    response_len: int
    micro_batch_size: int
    max_tokens: int
    iters: int
    warmup: int
    threads: int
    cudnn_sdpa: bool = True  # CUDA only: whether SDPA may pick its cuDNN backend
    lr: float = 1e-5
    seed: int = 0


@dataclass(frozen=True)
class Job:
    """One configuration: the baseline, or the engine at a world size with a micro-batch split."""

    name: str
    engine: bool
    world: int
    threads_per_rank: int
    micro_batch: dict = field(default_factory=dict)


# ---- data and loss -------------------------------------------------------------------------------


def make_batch(settings: Settings, seed: int, vocab: int) -> TensorDict:
    """Prompts of 1/4 to all of prompt_len real tokens (left-padded), responses of 1/8 to all of
    response_len (right-padded), pad id 0, and random advantages."""
    g = torch.Generator().manual_seed(seed)
    b, p, r = settings.batch, settings.prompt_len, settings.response_len
    prompt_real = torch.randint(max(1, p // 4), p + 1, (b,), generator=g)
    response_real = torch.randint(max(1, r // 8), r + 1, (b,), generator=g)
    prompt_mask = torch.arange(p)[None] >= (p - prompt_real)[:, None]
    response_mask = torch.arange(r)[None] < response_real[:, None]
    mask = torch.cat([prompt_mask, response_mask], 1).long()
    ids = torch.randint(4, vocab, (b, p + r), generator=g) * mask
    return TensorDict(
        {
            "input_ids": ids,
            "attention_mask": mask,
            "responses": ids[:, p:],
            "response_mask": mask[:, p:].clone(),
            "advantages": torch.randn(b, r, generator=g),
        },
        batch_size=[b],
    )


def make_batches(settings: Settings, vocab: int) -> list[TensorDict]:
    """Warm-up batches first, then one batch per timed step; every configuration gets the same."""
    return [make_batch(settings, settings.seed + i, vocab) for i in range(settings.warmup + settings.iters)]


def pg_token_mean(
    micro: TensorDict, outputs: dict[str, torch.Tensor], counts: GlobalCounts
) -> tuple[torch.Tensor, dict[str, float]]:
    """-advantage * log_prob, summed over response tokens and divided by the global token count."""
    loss = (-micro["advantages"] * outputs["log_probs"] * micro["response_mask"]).sum() / counts.tokens
    return loss, {}


# ---- the two training loops ---------------------------------------------------------------------


def baseline_step_fn(settings: Settings, device: torch.device) -> Callable[[TensorDict], None]:
    """A plain unsharded training step: padded forward per micro-batch, backward, clip, AdamW."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        settings.model_dir, dtype=torch.float32, attn_implementation="sdpa"
    ).to(device)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=settings.lr)
    # fp32 master weights with bf16 compute on CUDA, as the engine's mixed-precision policy does.
    use_bf16 = device.type == "cuda"
    width = settings.response_len

    def step(batch: TensorDict) -> None:
        batch = batch.to(device)
        total = batch["response_mask"].sum()
        for start in range(0, len(batch), settings.micro_batch_size):
            micro = batch[start : start + settings.micro_batch_size]
            ids, mask = micro["input_ids"], micro["attention_mask"]
            positions = (mask.cumsum(1) - 1).clamp(min=0)
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=use_bf16):
                logits = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits
            log_probs = torch.log_softmax(logits[:, -width - 1 : -1].float(), -1)
            picked = log_probs.gather(-1, ids[:, -width:, None]).squeeze(-1)
            loss = (-micro["advantages"] * picked * micro["response_mask"]).sum() / total
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def engine_step_fn(settings: Settings, micro_batch: dict) -> tuple[Callable[[TensorDict], None], FSDPEngine]:
    """FSDPEngine's training step (forward_backward_batch + optimizer_step); returns it and the engine."""
    from engines.config import EngineConfig
    from engines.fsdp.engine import FSDPEngine

    config = EngineConfig(
        model_path=settings.model_dir,
        device=settings.device,
        micro_batch=micro_batch,
        optim={"lr": settings.lr, "grad_clip": 1.0},
    )
    engine = FSDPEngine(config)
    engine.initialize()

    def step(batch: TensorDict) -> None:
        engine.forward_backward_batch(batch, pg_token_mean)
        engine.optimizer_step()

    return step, engine


class Turns:
    """Steps of all configurations in rotation: round k runs every configuration's step k, one at a
    time, starting one further along each round. A neighbour's load on shared cores then falls on all
    configurations alike, and no two configurations ever compute at once."""

    def __init__(self, ctx: BaseContext, slots: int, timeout_s: float = 1800.0) -> None:
        self.slots, self.timeout_s = slots, timeout_s
        self._turn = ctx.Value("i", 0, lock=False)  # guarded by the condition's lock
        self._cond = ctx.Condition()

    def wait(self, step: int, slot: int) -> None:
        target = step * self.slots + (slot - step) % self.slots
        with self._cond:
            if not self._cond.wait_for(lambda: self._turn.value >= target, timeout=self.timeout_s):
                raise TimeoutError(f"configuration {slot} waited {self.timeout_s}s for its step {step}")

    def done(self) -> None:
        with self._cond:
            self._turn.value += 1
            self._cond.notify_all()


def timed_steps(
    step: Callable[[TensorDict], None],
    batches: list[TensorDict],
    sync: Callable[[], None],
    turn: Callable[[int], AbstractContextManager[None]],
) -> tuple[list[float], list[float]]:
    """Wall and CPU seconds of every step; `sync` lines up the ranks and the device.

    CPU seconds count every thread of the process: well under wall * threads means the process was
    kept waiting (by a neighbour on shared cores, or by another rank)."""
    wall, cpu = [], []
    for i, batch in enumerate(batches):
        with turn(i):
            sync()
            start, start_cpu = time.perf_counter(), time.process_time()
            step(batch)
            sync()
            wall.append(time.perf_counter() - start)
            cpu.append(time.process_time() - start_cpu)
    return wall, cpu


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


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


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


def micro_batches_per_step(job: Job, settings: Settings, batches: list[TensorDict]) -> float:
    """Mean micro-batches a rank runs per timed step (rank 0's share; every rank runs as many)."""
    from engines.microbatch import dynamic_micro_batches, fixed_micro_batches

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
    return statistics.mean(counts)


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
        "micro_batches_per_rank_step": round(micro_batches_per_step(job, settings, batches), 2),
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


def parse_settings(argv: list[str] | None, model_dir_root: str) -> tuple[Settings, float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model", default=None, help="built-in model (default qwen2-20m; qwen2-1m with --quick)"
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
    from engines.tiny_models import build_builtin_model

    settings = Settings(
        model=model,
        model_dir=str(build_builtin_model(model, model_dir_root)),
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
