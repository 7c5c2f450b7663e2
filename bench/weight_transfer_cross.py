"""Cross-process weight transfer: a training rank to a rollout worker in another process, over the
strategies of workers/transfer_choice.py (`collective`: gloo on CPU / NCCL on GPU; `object_store`:
Ray's), against a plain copy of the same bytes, in one run.

Real worker groups on a local Ray: one ActorRefWorker rank and one RolloutWorker per strategy,
linked as a split job links them; each timed transfer is `weight_sync/seconds` of
`sync_weights()` (gather, cast, pack, move, unpack, copy into the rollout engine, version bump).
The baseline is `dst.copy_(src)` over the model's tensors in the driver, one torch thread (the
ranks run one each on a small model), interleaved with the transfers. GB/s counts the model's
bytes once; `ratio_vs_copy` is transfer GB/s over copy GB/s (medians), `ratio_vs_copy_best` from
the best repeat of each. bench/weight_sync.py runs this with --cross-process.

    python bench/weight_transfer_cross.py [--model qwen2-20m] [--iters 5] [--bucket-mb 512] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

STRATEGIES = ("collective", "object_store")


def plain_copy(model_dir: str) -> tuple[Callable[[], float], int]:
    """A timed copy of the model's tensors into fresh ones, and the bytes it moves."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    pairs = [(torch.empty_like(t), t.detach()) for t in model.state_dict().values()]
    nbytes = sum(t.numel() * t.element_size() for _, t in pairs)

    def once() -> float:
        start = time.perf_counter()
        for dst, src in pairs:
            dst.copy_(src)
        return time.perf_counter() - start

    return once, nbytes


def start_pair(strategy: str, model_dir: str, bucket_mb: float):
    from controller.resource_pool import ResourcePool
    from controller.worker_group import RayWorkerGroup
    from workers.actor_role import ActorRefWorker
    from workers.rollout_role import RolloutWorker
    from workers.transfer_choice import RolloutLink

    pools = [ResourcePool(1, cpus_per_bundle=1, name=f"bench-{strategy}-{r}") for r in ("train", "rollout")]
    rollout_cfg = {"bucket_mb": bucket_mb, "free_cache_after_generate": False}
    trainer = RayWorkerGroup(
        pools[0],
        ActorRefWorker,
        {"actor": {"model_path": model_dir, "trainable": False}, "rollout": rollout_cfg},
        group_name=f"bench-{strategy}-train",
    )
    rollout = RayWorkerGroup(
        pools[1],
        RolloutWorker,
        {"model_path": model_dir, "rollout": rollout_cfg},
        group_name=f"bench-{strategy}-rollout",
    )
    trainer.connect_rollout(RolloutLink(rollout.actors, rollout.name, strategy, timeout_s=300))
    return pools, trainer, rollout


def run(args: argparse.Namespace, model_dir: str) -> list[dict]:
    copy_once, nbytes = plain_copy(model_dir)
    torch.set_num_threads(1)
    pairs = {s: start_pair(s, model_dir, args.bucket_mb) for s in STRATEGIES}
    copies: list[float] = []
    transfers: dict[str, list[float]] = {s: [] for s in STRATEGIES}
    buckets: dict[str, float] = {}
    for i in range(args.warmup + args.iters):
        copies.append(copy_once())
        for s, (_, trainer, _) in pairs.items():
            m = trainer.sync_weights()[0]
            transfers[s].append(m["weight_sync/seconds"])
            buckets[s] = m["weight_sync/buckets"]
            assert m["weight_sync/bytes"] == nbytes, (m, nbytes)
        print(f"  iter {i + 1}: copy {copies[-1] * 1e3:.1f} ms, " + ", ".join(
            f"{s} {transfers[s][-1] * 1e3:.1f} ms" for s in STRATEGIES), file=sys.stderr, flush=True)  # fmt: skip
    w = args.warmup
    copy_s, copy_best = statistics.median(copies[w:]), min(copies[w:])
    lines = []
    for s in STRATEGIES:
        t, best = statistics.median(transfers[s][w:]), min(transfers[s][w:])
        lines.append(
            {
                "bench": "weight_sync",
                "config": "cross_process",
                "strategy": s,
                "model": args.model,
                "device": "cpu",
                "bucket_mb": args.bucket_mb,
                "buckets": buckets[s],
                "bytes": nbytes,
                "iters": args.iters,
                "transfer_ms": round(t * 1e3, 2),
                "transfer_gbps": round(nbytes / t / 1e9, 3),
                "copy_ms": round(copy_s * 1e3, 2),
                "copy_gbps": round(nbytes / copy_s / 1e9, 3),
                "ratio_vs_copy": round(copy_s / t, 3),
                "ratio_vs_copy_best": round(copy_best / best, 3),
                "loadavg_1m": round(os.getloadavg()[0], 2),
            }
        )
    for pools, trainer, rollout in pairs.values():
        trainer.shutdown()
        rollout.shutdown()
        for pool in pools:
            pool.remove()
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="built-in model (default qwen2-20m; --quick: qwen2-1m)")
    parser.add_argument("--iters", type=int, default=None, help="timed repeats (default 5, 3 with --quick)")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--bucket-mb", type=float, default=512, help="the job default, 512")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    args.model = args.model or ("qwen2-1m" if args.quick else "qwen2-20m")
    args.iters = args.iters or (3 if args.quick else 5)
    import ray

    from engines.models.tiny_models import build_builtin_model

    with tempfile.TemporaryDirectory() as root:
        model_dir = str(build_builtin_model(args.model, root))
        ray.init(num_cpus=4, include_dashboard=False, logging_level="error",
                 runtime_env={"env_vars": {"PYTHONPATH": str(REPO)}})  # fmt: skip
        try:
            for line in run(args, model_dir):
                print(json.dumps(line), flush=True)
        finally:
            ray.shutdown()


if __name__ == "__main__":
    main()
