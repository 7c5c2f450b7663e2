"""The fused CPU kernels (engines/cpu_kernels.py) against the eager ops they replace.

SwiGLU (`silu(gate) * up` and its backward) at [tokens, intermediate] and the RMSNorm Function
(forward + backward) at [tokens, hidden], each timed with the kernels and with `TANDEM_CPU_KERNELS=0`
(the eager path) in one process, alternating which runs first. Defaults: SmolLM2-135M's shapes at a
GRPO micro-batch (1312 packed tokens, hidden 576, intermediate 1536). Prints one JSON line.

    python bench/cpu_kernels.py [--tokens 1312] [--hidden 576] [--intermediate 1536] [--threads 2]
        [--iters 30]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=1312)
    parser.add_argument("--hidden", type=int, default=576)
    parser.add_argument("--intermediate", type=int, default=1536)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--iters", type=int, default=30)
    args = parser.parse_args()
    from engines import cpu_kernels, swiglu
    from engines.host_memory import keep_freed_memory
    from engines.rms_norm import RMSNormFunction

    torch.set_num_threads(args.threads)
    keep_freed_memory()  # as a rank runs
    if cpu_kernels.kernels() is None:
        raise SystemExit("the kernels did not build on this machine (see the warning above)")
    g = torch.Generator().manual_seed(0)
    gate, up = (
        torch.randn(args.tokens, args.intermediate, generator=g),
        torch.randn(args.tokens, args.intermediate, generator=g),
    )
    x, weight = torch.randn(args.tokens, args.hidden, generator=g), torch.rand(args.hidden, generator=g) + 0.5
    grad_mlp, grad_norm = torch.randn_like(gate), torch.randn_like(x)

    def run_swiglu() -> None:
        a, b = gate.detach().requires_grad_(True), up.detach().requires_grad_(True)
        swiglu.swiglu(a, b, torch.nn.functional.silu).backward(grad_mlp)

    def run_norm() -> None:
        a, w = x.detach().requires_grad_(True), weight.detach().requires_grad_(True)
        RMSNormFunction.apply(a, w, 1e-5).backward(grad_norm)

    times: dict[str, list[float]] = {}
    for i in range(args.iters + 1):  # the first round warms up
        for mode in ("fused", "eager") if i % 2 else ("eager", "fused"):
            os.environ["TANDEM_CPU_KERNELS"] = "1" if mode == "fused" else "0"
            for name, fn in (("swiglu", run_swiglu), ("rms_norm", run_norm)):
                start = time.perf_counter()
                fn()
                if i:
                    times.setdefault(f"{name}_{mode}_ms", []).append(1e3 * (time.perf_counter() - start))
    line: dict = {"bench": "cpu_kernels", "tokens": args.tokens, "hidden": args.hidden,
                  "intermediate": args.intermediate, "threads": args.threads, "iters": args.iters}  # fmt: skip
    line.update({k: round(statistics.median(v), 4) for k, v in times.items()})
    for name in ("swiglu", "rms_norm"):
        line[f"ratio_{name}_fused_vs_eager"] = round(line[f"{name}_fused_ms"] / line[f"{name}_eager_ms"], 4)
    line["load_average"] = os.getloadavg()
    print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
