"""Weight-sync bandwidth: InProcessTransfer (FSDPEngine → HFRolloutEngine) against a plain tensor copy.

The baseline is the memory-bandwidth ceiling for the same tensor list: one preallocated destination
per parameter, `dst.copy_(src)`, in the rollout dtype (fp32 on CPU, bf16 on CUDA), in the same
process and thread count (1 per rank by default: steadier on shared cores), interleaved with the
syncs so a neighbour's load falls on both alike. A sync is timed as `TransferStats.seconds` (gather,
cast, bucket, copy into the rollout, version bump). GB/s counts the bytes delivered once (not read
+ write), for both; `ratio_vs_copy` is sync GB/s over copy GB/s (medians), `ratio_vs_copy_best`
the same from the best repeat of each.

World size 1 runs one process; world size 2 runs two gloo (NCCL on CUDA) processes, each gathering
its half of every FSDP shard and syncing into its own rollout engine, as the hybrid worker does; a
rank's figures are its own. Peak extra memory of one sync is measured after the timings
(torch.cuda.max_memory_allocated on GPU; on CPU the RSS high-water mark, reset through
/proc/self/clear_refs, after malloc_trim so that reused heap pages count again) and set
against the model's bytes: streaming holds about one bucket, never the whole state dict.

    .venv/bin/python bench/weight_sync.py [--model qwen2-20m] [--device cpu|cuda] [--iters 10] [--quick]

With --cross-process it runs bench/weight_transfer_cross.py instead: a training rank sending to a
rollout worker in another process, over both cross-process strategies, against a plain copy.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import resource
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.harness import free_port, ratio  # noqa: E402

if TYPE_CHECKING:
    from engines.rollout.hf import HFRolloutEngine
    from engines.training.fsdp.engine import FSDPEngine
    from engines.transfer.in_process import InProcessTransfer


@dataclass(frozen=True)
class Settings:
    """One benchmark run, resolved from the command line; handed to every worker process."""

    model: str
    model_dir: str
    device: str
    buckets_mb: tuple[float, ...]
    worlds: tuple[int, ...]
    iters: int
    warmup: int
    threads: int


# ---- timing and memory ---------------------------------------------------------------------------


def device_sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], object], device: torch.device) -> float:
    device_sync(device)
    start = time.perf_counter()
    fn()
    device_sync(device)
    return time.perf_counter() - start


def rss_kib() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") // 1024


def trim_malloc() -> None:
    """Hand free heap pages back to the OS, so that reusing them shows in RSS again (glibc keeps
    freed tensors in its heap: without this, a sync refilling them would look free)."""
    ctypes.CDLL("libc.so.6").malloc_trim(0)


def peak_extra_mib(fn: Callable[[], object], device: torch.device) -> float:
    """Memory held at the peak of `fn` above what was held when it started."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        fn()
        torch.cuda.synchronize(device)
        return (torch.cuda.max_memory_allocated(device) - before) / 2**20
    trim_malloc()
    Path("/proc/self/clear_refs").write_text("5")  # high-water mark := current RSS
    before = rss_kib()
    fn()
    return (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024  # KiB on Linux


# ---- one rank ------------------------------------------------------------------------------------


def build_engines(settings: Settings) -> tuple[FSDPEngine, HFRolloutEngine]:
    from engines.rollout.hf import HFRolloutEngine
    from engines.training.fsdp.engine import FSDPEngine
    from schema.engine import EngineConfig

    engine = FSDPEngine(EngineConfig(model_path=settings.model_dir, device=settings.device, trainable=False))
    engine.initialize()
    rollout = HFRolloutEngine(settings.model_dir, device=str(engine.device), dtype="auto")
    return engine, rollout


def sources_of(engine: FSDPEngine, dtype: torch.dtype) -> list[torch.Tensor]:
    return [t.to(dtype, copy=True) for _, t in engine.get_per_tensor_param()]


def time_copies_and_syncs(
    engine: FSDPEngine,
    rollout: HFRolloutEngine,
    syncs: dict[float, InProcessTransfer],
    settings: Settings,
    barrier: Callable[[], None],
) -> dict:
    """Copies and syncs interleaved, then one more sync per bucket size for its peak memory."""
    from engines.transfer.base import tensor_bytes

    device = engine.device
    # The baseline's (destination, source) pairs: fresh tensors in the rollout dtype.
    pairs = [(torch.empty_like(s), s) for s in sources_of(engine, rollout.dtype)]
    model_bytes = sum(tensor_bytes(src) for _, src in pairs)

    def copy_all() -> None:
        for dst, src in pairs:
            dst.copy_(src)

    copy_s: list[float] = []
    sync_s: dict[float, list[float]] = {mb: [] for mb in syncs}
    for i in range(settings.warmup + settings.iters):
        barrier()
        seconds = timed(copy_all, device)
        copy_s.append(seconds)
        for mb, sync in syncs.items():
            barrier()
            sync_s[mb].append(sync.transfer(engine.get_per_tensor_param()).seconds)
        print(
            f"  rank {os.environ['RANK']} iter {i + 1}: copy {seconds * 1e3:.1f} ms",
            file=sys.stderr,
            flush=True,
        )
    pairs.clear()  # the baseline's two model copies are not part of any sync's memory
    w = settings.warmup
    buckets = {str(mb): bucket_result(sync, sync_s[mb][w:], engine, barrier) for mb, sync in syncs.items()}
    return {
        "model_bytes": model_bytes,
        "copy_s": statistics.median(copy_s[w:]),
        "copy_best_s": min(copy_s[w:]),
        "buckets": buckets,
    }


def bucket_result(sync: InProcessTransfer, seconds: list[float], engine: FSDPEngine, barrier) -> dict:
    """One bucket size's timed syncs, then one more sync for its peak memory."""
    stats = sync.last
    barrier()
    memory = peak_extra_mib(lambda: sync.transfer(engine.get_per_tensor_param()), engine.device)
    return {
        "sync_s": statistics.median(seconds),
        "sync_best_s": min(seconds),
        "bytes": stats.bytes,
        "buckets": stats.buckets,
        "max_bucket_bytes": stats.max_bucket_bytes,
        "peak_extra_mib": memory,
    }


def worker(rank: int, world: int, settings: Settings, port: int, out_dir: str) -> None:
    """One rank: a cold first sync, then timed copies and syncs, then memory."""
    import torch.distributed as dist

    from engines.transfer.in_process import InProcessTransfer

    torch.set_num_threads(settings.threads)
    os.environ.update(
        {
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(world),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
        }
    )
    engine, rollout = build_engines(settings)

    def barrier() -> None:
        device_sync(engine.device)
        dist.barrier()  # ranks start each measurement together, as they sync together in training

    syncs = {mb: InProcessTransfer(rollout, mb) for mb in settings.buckets_mb}
    barrier()
    first = syncs[max(settings.buckets_mb)].transfer(
        engine.get_per_tensor_param()
    )  # the cold one, on fresh weights
    result = {
        "tensors": first.tensors,
        "first_sync_s": first.seconds,
        **time_copies_and_syncs(engine, rollout, syncs, settings, barrier),
    }
    Path(out_dir, f"world{world}-rank{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


def run_world(world: int, settings: Settings, out_dir: str) -> list[dict]:
    print(f"== world size {world}: {settings.threads} thread(s) per rank", file=sys.stderr, flush=True)
    mp.spawn(worker, args=(world, settings, free_port(), out_dir), nprocs=world, join=True)
    return [json.loads(Path(out_dir, f"world{world}-rank{r}.json").read_text()) for r in range(world)]


# ---- report -------------------------------------------------------------------------------------


def report(world: int, ranks: list[dict], settings: Settings) -> list[dict]:
    """One line per (bucket size, rank)."""
    common = {
        "model": settings.model,
        "device": settings.device,
        "world_size": world,
        "dtype": "bfloat16" if settings.device == "cuda" else "float32",
        "threads_per_rank": settings.threads,
        "iters": settings.iters,
        "peak_mem_kind": "torch.cuda.max_memory_allocated delta"
        if settings.device == "cuda"
        else "ru_maxrss delta (high-water mark reset via /proc/self/clear_refs, after malloc_trim(0))",
    }
    return [sync_line(common, rank, r, mb) for rank, r in enumerate(ranks) for mb in settings.buckets_mb]


def sync_line(common: dict, rank: int, r: dict, mb: float) -> dict:
    """One bucket size on one rank: the sync's bandwidth against the copy's, and its peak memory."""
    b, model_mib = r["buckets"][str(mb)], r["model_bytes"] / 2**20
    sync_gbps, copy_gbps = b["bytes"] / b["sync_s"] / 1e9, r["model_bytes"] / r["copy_s"] / 1e9
    return {
        "bench": "weight_sync",
        **common,
        "config": "sync",
        "rank": rank,
        "bucket_mb": mb,
        "tensors": r["tensors"],
        "buckets": b["buckets"],
        "bytes": b["bytes"],
        "sync_ms": round(b["sync_s"] * 1e3, 2),
        "sync_gbps": round(sync_gbps, 3),
        "copy_ms": round(r["copy_s"] * 1e3, 2),
        "copy_gbps": round(copy_gbps, 3),
        "ratio_vs_copy": ratio(sync_gbps, copy_gbps),
        # best of the timed repeats: the least disturbed by neighbours on shared cores
        "ratio_vs_copy_best": ratio(r["copy_best_s"], b["sync_best_s"]),
        "first_sync_ratio_vs_copy": ratio(r["copy_s"], r["first_sync_s"]),
        "peak_extra_mib": round(b["peak_extra_mib"], 1),
        "max_bucket_mib": round(b["max_bucket_bytes"] / 2**20, 1),
        "model_mib": round(model_mib, 1),
        "peak_extra_vs_model": ratio(b["peak_extra_mib"], model_mib),
        "loadavg_1m": round(os.getloadavg()[0], 2),
    }


def parse_settings(argv: list[str] | None, model_root: str) -> Settings:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="built-in model or HF folder (default qwen2-20m)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--iters", type=int, default=None, help="timed repeats (default 10, 3 with --quick)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed repeats first")
    parser.add_argument("--buckets-mb", type=float, nargs="+", default=None, help="default 1 16 64 512")
    parser.add_argument("--worlds", type=int, nargs="+", default=None, help="world sizes (default 1 2)")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads per rank (1: robust to neighbours on shared cores)",
    )
    parser.add_argument("--quick", action="store_true", help="qwen2-1m, buckets 1 and 512 MB, 3 iters")
    args = parser.parse_args(argv)
    model = args.model or ("qwen2-1m" if args.quick else "qwen2-20m")
    if Path(model).is_dir():
        model_dir = model
    else:
        from engines.models.tiny_models import build_builtin_model

        model_dir = str(build_builtin_model(model, model_root))
    worlds = tuple(args.worlds or (1, 2))
    if args.device == "cuda" and max(worlds) > torch.cuda.device_count():
        print(f"skipping world sizes above {torch.cuda.device_count()} (one GPU per rank)", file=sys.stderr)
        worlds = tuple(w for w in worlds if w <= torch.cuda.device_count())
    return Settings(
        model=model,
        model_dir=model_dir,
        device=args.device,
        buckets_mb=tuple(args.buckets_mb or ((1, 512) if args.quick else (1, 16, 64, 512))),
        worlds=worlds,
        iters=args.iters or (3 if args.quick else 10),
        warmup=args.warmup,
        threads=args.threads,
    )


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if "--cross-process" in argv:
        from bench.weight_transfer_cross import main as cross_process

        cross_process([a for a in argv if a != "--cross-process"])
        return
    with tempfile.TemporaryDirectory() as root:
        settings = parse_settings(argv, root)
        print(f"settings: {json.dumps(asdict(settings))}", file=sys.stderr, flush=True)
        for world in settings.worlds:
            for line in report(world, run_world(world, settings, root), settings):
                print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
