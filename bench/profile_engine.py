"""Where the time of one FSDPEngine training step goes: torch.profiler over a few steps.

Prints JSON lines: the step time of the engine and of a plain transformers loop on the same batch
(the ratio, as in bench/train_engine.py), then the top operators by self CPU time and by device
time, so a slow step can be traced to the code that costs it.

    python bench/profile_engine.py [--device cuda] [--model qwen2-20m | FOLDER] [--top 20] [--fresh] [--plain]

`--fresh` gives every step a new batch (new random lengths, as RL batches are), `--plain` also
profiles the plain loop.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time

import torch

sys.path.insert(0, __file__.rsplit("/bench/", 1)[0])

from engines.config import EngineConfig  # noqa: E402
from engines.fsdp.engine import FSDPEngine  # noqa: E402
from engines.tiny_models import builtin_or_folder  # noqa: E402
from tests.engine_util import make_batch, pg_loss, reference_loss  # noqa: E402


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def time_steps(step, device: str, iters: int) -> float:
    for _ in range(2):
        step()
    sync(device)
    start = time.perf_counter()
    for _ in range(iters):
        step()
    sync(device)
    return (time.perf_counter() - start) / iters


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--model", default="qwen2-20m")
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--top", type=int, default=20)
    parser.add_argument("--fresh", action="store_true", help="a new batch (new lengths) every step")
    parser.add_argument("--plain", action="store_true", help="profile the plain loop too")
    args = parser.parse_args()
    from transformers import AutoModelForCausalLM

    model_dir = str(builtin_or_folder(args.model, tempfile.mkdtemp()))
    batches = [
        make_batch(batch_size=16, prompt_len=64, resp_len=192, seed=i).to(args.device)
        for i in range(64 if args.fresh else 1)
    ]
    turn = iter(range(10**9))

    def next_batch():
        return batches[next(turn) % len(batches)]

    engine = FSDPEngine(
        EngineConfig(model_path=model_dir, device=args.device, micro_batch={"micro_batch_size": 4})
    )
    engine.initialize()
    loss_fn = pg_loss("token-mean")

    def engine_step() -> None:
        batch = next_batch()
        with engine.train_mode():
            engine.forward_backward_batch(batch, loss_fn)
            engine.optimizer_step()

    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    plain = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="sdpa"
    ).to(args.device)
    optim = torch.optim.AdamW(plain.parameters(), lr=1e-5)

    def plain_step() -> None:
        batch = next_batch()
        for i in range(0, 16, 4):
            with torch.autocast(args.device, dtype=dtype, enabled=args.device == "cuda"):
                loss = reference_loss(plain, batch[i : i + 4], "token-mean")
            loss.backward()
        torch.nn.utils.clip_grad_norm_(plain.parameters(), 1.0)
        optim.step()
        optim.zero_grad()

    engine_s = time_steps(engine_step, args.device, args.iters)
    plain_s = time_steps(plain_step, args.device, args.iters)
    print(json.dumps({"bench": "profile_engine", "device": args.device, "model": args.model,
                      "engine_step_s": engine_s, "plain_step_s": plain_s, "ratio": plain_s / engine_s}), flush=True)  # fmt: skip
    activities = [torch.profiler.ProfilerActivity.CPU]
    if args.device == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    for name, step in [("engine", engine_step)] + ([("plain", plain_step)] if args.plain else []):
        with torch.profiler.profile(activities=activities) as prof:
            for _ in range(args.iters):
                step()
            sync(args.device)
        events = prof.key_averages()
        device_ms = sum(getattr(e, "self_device_time_total", 0) for e in events) / 1e3 / args.iters
        print(json.dumps({"bench": "profile_engine", "loop": name, "device_busy_ms_per_step": device_ms}))
        for sort_key in ("self_cpu_time_total", "self_device_time_total"):
            if sort_key == "self_device_time_total" and args.device != "cuda":
                continue
            top = sorted(events, key=lambda e: getattr(e, sort_key, 0), reverse=True)[: args.top]
            rows = [{"op": e.key[:80], "calls": e.count, "self_cpu_ms": e.self_cpu_time_total / 1e3 / args.iters,
                     "self_device_ms": getattr(e, "self_device_time_total", 0) / 1e3 / args.iters} for e in top]  # fmt: skip
            print(json.dumps({"bench": "profile_engine", "loop": name, "sorted_by": sort_key, "per_step": rows}), flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
