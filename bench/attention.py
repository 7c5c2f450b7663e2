"""Packed-row attention: one batched causal SDPA call (engines/attention.py) against one call per sequence.

Forward + backward over a GRPO-sized packed micro-batch (128 sequences of 6-14 tokens by default),
alternating the two in the same process; prints one JSON line with each median and the ratio.

    python bench/attention.py [--sequences 128] [--heads 4] [--kv-heads 2] [--dim 32] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engines.attention import segment_attention  # noqa: E402
from tests.test_attention import per_sequence_reference  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sequences", type=int, default=128)
    parser.add_argument("--min-len", type=int, default=6)
    parser.add_argument("--max-len", type=int, default=14)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--dim", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--iters", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    lengths = torch.randint(args.min_len, args.max_len + 1, (args.sequences,))
    edges = [0, *lengths.cumsum(0).tolist()]
    n = edges[-1]
    q = torch.randn(1, args.heads, n, args.dim, requires_grad=True)
    k = torch.randn(1, args.kv_heads, n, args.dim, requires_grad=True)
    v = torch.randn(1, args.kv_heads, n, args.dim, requires_grad=True)
    module = torch.nn.Module().train()
    runs = {
        "per_sequence": lambda: per_sequence_reference(q, k, v, edges),
        "batched": lambda: segment_attention(module, q, k, v, None, cu_seq_lens_q=torch.tensor(edges))[0],
    }
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(args.iters):
        for name, run in runs.items():
            start = time.perf_counter()
            run().sum().backward()
            times[name].append(time.perf_counter() - start)
    base, new = (statistics.median(times[name][1:]) for name in runs)
    print(json.dumps({
        "bench": "attention", "sequences": args.sequences, "tokens": n, "threads": args.threads,
        "per_sequence_s": round(base, 5), "batched_s": round(new, 5), "ratio_batched_vs_per_sequence": round(new / base, 3),
    }))  # fmt: skip


if __name__ == "__main__":
    main()
