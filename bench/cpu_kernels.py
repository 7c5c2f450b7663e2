"""The fused CPU kernels (engines/kernels/cpu_kernels.py) against the eager ops they replace.

SwiGLU (`silu(gate) * up` and its backward) at [tokens, intermediate], the RMSNorm Function
(forward + backward) at [tokens, hidden], rotary embedding (RotaryFunction forward + backward of q
and k laid out as the attention makes them) and the vocabulary head's log-probs and entropy
(`token_log_probs` forward + backward of `--head-tokens` tokens: the products and the element-wise
passes, of which only the latter change), each timed with the kernels and with
`TANDEM_CPU_KERNELS=0` (the eager path) in one process, alternating which runs first. Defaults:
SmolLM2-135M's shapes at a GRPO micro-batch (1312 packed tokens, hidden 576, intermediate 1536, 9
query and 3 key heads of 64, a 49152-token vocabulary, 1024 response tokens). Prints one JSON line.

    python bench/cpu_kernels.py [--tokens 1312] [--hidden 576] [--intermediate 1536] [--heads 9]
        [--kv-heads 3] [--head-dim 64] [--vocab 49152] [--head-tokens 1024] [--threads 2] [--iters 30]
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
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--head-tokens", type=int, default=1024)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--iters", type=int, default=30)
    args = parser.parse_args()
    from engines.host_memory import keep_freed_memory
    from engines.kernels import cpu_kernels, fused_layers
    from engines.kernels.fused_layers import RMSNormFunction, RotaryFunction
    from engines.kernels.logprobs import token_log_probs

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
        fused_layers.swiglu(a, b, torch.nn.functional.silu).backward(grad_mlp)

    def run_norm() -> None:
        a, w = x.detach().requires_grad_(True), weight.detach().requires_grad_(True)
        RMSNormFunction.apply(a, w, 1e-5).backward(grad_norm)

    tokens, dim = args.tokens, args.head_dim
    q = torch.randn(1, tokens, args.heads * dim, generator=g)
    k = torch.randn(1, tokens, args.kv_heads * dim, generator=g)
    angles = torch.outer(torch.arange(tokens, dtype=torch.float32), torch.rand(dim // 2, generator=g))
    cos, sin = torch.cat([angles, angles], -1)[None].cos(), torch.cat([angles, angles], -1)[None].sin()
    grad_q = torch.randn(1, tokens, args.heads, dim, generator=g).transpose(1, 2)
    grad_k = torch.randn(1, tokens, args.kv_heads, dim, generator=g).transpose(1, 2)
    hidden = torch.randn(args.head_tokens, args.hidden, generator=g)
    head = torch.randn(args.vocab, args.hidden, generator=g) * 0.05
    targets = torch.randint(0, args.vocab, (args.head_tokens,), generator=g)
    weights = torch.randn(2, args.head_tokens, generator=g)

    def run_rotary() -> None:  # q, k as [1, heads, tokens, dim] views of the projections
        a, b = q.detach().requires_grad_(True), k.detach().requires_grad_(True)
        views = [t.view(1, tokens, -1, dim).transpose(1, 2) for t in (a, b)]
        out_q, out_k = RotaryFunction.apply(*views, cos, sin, 1)
        torch.autograd.backward((out_q, out_k), (grad_q, grad_k))

    def run_head() -> None:
        h, w = hidden.detach().requires_grad_(True), head.detach().requires_grad_(True)
        log_probs, entropy = token_log_probs(h, w, targets, 1.0, True, args.head_tokens)
        ((weights[0] * log_probs).sum() + (weights[1] * entropy).sum()).backward()

    kernels = (("swiglu", run_swiglu), ("rms_norm", run_norm), ("rotary", run_rotary), ("head", run_head))
    times: dict[str, list[float]] = {}
    for i in range(args.iters + 1):  # the first round warms up
        for mode in ("fused", "eager") if i % 2 else ("eager", "fused"):
            os.environ["TANDEM_CPU_KERNELS"] = "1" if mode == "fused" else "0"
            for name, fn in kernels:
                start = time.perf_counter()
                fn()
                if i:
                    times.setdefault(f"{name}_{mode}_ms", []).append(1e3 * (time.perf_counter() - start))
    line: dict = {"bench": "cpu_kernels", "tokens": args.tokens, "hidden": args.hidden,
                  "intermediate": args.intermediate, "heads": args.heads, "kv_heads": args.kv_heads,
                  "head_dim": dim, "vocab": args.vocab, "head_tokens": args.head_tokens,
                  "threads": args.threads, "iters": args.iters}  # fmt: skip
    line.update({k: round(statistics.median(v), 4) for k, v in times.items()})
    for name, _ in kernels:
        line[f"ratio_{name}_fused_vs_eager"] = round(line[f"{name}_fused_ms"] / line[f"{name}_eager_ms"], 4)
    line["load_average"] = os.getloadavg()
    print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
