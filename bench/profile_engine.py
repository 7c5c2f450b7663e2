"""Where the time of one FSDPEngine training step goes: torch.profiler over a few steps.

Prints JSON lines: the step time of the engine and of a plain transformers loop on the same batch
(the ratio, as in bench/train_engine.py), then the top operators by self CPU time and by device
time, so a slow step can be traced to the code that costs it.

    python bench/profile_engine.py [--device cuda] [--model qwen2-20m] [--top 20]
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
from engines.tiny_models import build_builtin_model  # noqa: E402
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
    args = parser.parse_args()
    from transformers import AutoModelForCausalLM

    model_dir = str(build_builtin_model(args.model, tempfile.mkdtemp()))
    batch = make_batch(batch_size=16, prompt_len=64, resp_len=192, seed=0).to(args.device)
    engine = FSDPEngine(
        EngineConfig(model_path=model_dir, device=args.device, micro_batch={"micro_batch_size": 4})
    )
    engine.initialize()
    loss_fn = pg_loss("token-mean")

    def engine_step() -> None:
        with engine.train_mode():
            engine.forward_backward_batch(batch, loss_fn)
            engine.optimizer_step()

    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    plain = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="sdpa"
    ).to(args.device)
    optim = torch.optim.AdamW(plain.parameters(), lr=1e-5)

    def plain_step() -> None:
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
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(args.iters):
            engine_step()
        sync(args.device)
    events = prof.key_averages()
    for sort_key in ("self_cpu_time_total", "self_device_time_total"):
        if sort_key == "self_device_time_total" and args.device != "cuda":
            continue
        top = sorted(events, key=lambda e: getattr(e, sort_key, 0), reverse=True)[: args.top]
        rows = [{"op": e.key[:80], "calls": e.count, "self_cpu_ms": e.self_cpu_time_total / 1e3 / args.iters,
                 "self_device_ms": getattr(e, "self_device_time_total", 0) / 1e3 / args.iters} for e in top]  # fmt: skip
        print(json.dumps({"bench": "profile_engine", "sorted_by": sort_key, "per_step": rows}), flush=True)


if __name__ == "__main__":
    main()
