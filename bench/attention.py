"""Packed-row attention: one batched causal SDPA call (engines/kernels/attention.py) against one call per sequence.

Forward + backward over a GRPO-sized packed micro-batch (128 sequences of 6-14 tokens by default),
alternating the two in the same process; prints one JSON line with each median and the ratio.

`--shared-prompt` measures instead the shared-prompt path (engines/kernels/shared_prompt.py: each group's
prompt once, its responses reading it) against the same rows unshared (every row its own copy of
the prompt, one batched causal call): SmolLM2-135M's attention shape by default, `--groups` groups
of `--n` responses of up to `--response-len` tokens (lengths vary, as responses end at EOS).

    python bench/attention.py [--sequences 128] [--heads 4] [--kv-heads 2] [--dim 32] [--threads 1]
    python bench/attention.py --shared-prompt [--groups 4 --n 8 --prompt-len 36 --response-len 16]
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

from engines.kernels import shared_attention  # noqa: E402
from engines.kernels.attention import segment_attention  # noqa: E402
from tests.test_attention import per_sequence_reference  # noqa: E402


def alternate(runs: dict, iters: int) -> list[float]:
    """Median forward + backward seconds of each run (the first repeat dropped), runs alternating."""
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(iters):
        for name, run in runs.items():
            start = time.perf_counter()
            run().sum().backward()
            times[name].append(time.perf_counter() - start)
    return [statistics.median(times[name][1:]) for name in runs]


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
    parser.add_argument("--shared-prompt", action="store_true")
    parser.add_argument("--groups", type=int, default=4)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=36)
    parser.add_argument("--response-len", type=int, default=16)
    args = parser.parse_args()
    if args.iters < 2:
        parser.error("--iters must be at least 2: the first repeat is a warm-up, dropped from the median")
    torch.set_num_threads(args.threads)
    if args.shared_prompt:
        shared_prompt(args)
        return
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
    base, new = alternate(runs, args.iters)
    print(json.dumps({
        "bench": "attention", "sequences": args.sequences, "tokens": n, "threads": args.threads,
        "per_sequence_s": round(base, 5), "batched_s": round(new, 5), "ratio_batched_vs_per_sequence": round(new / base, 3),
    }))  # fmt: skip


def shared_prompt(args: argparse.Namespace) -> None:
    """The shared-prompt attention against the unshared rows' batched causal attention."""
    from engines.kernels.shared_prompt import pack_shared, prompt_groups

    heads, kv_heads, dim = (
        (9, 3, 64) if args.heads == 4 and args.dim == 32 else (args.heads, args.kv_heads, args.dim)
    )
    g = torch.Generator().manual_seed(0)
    rows, prompt_len, width = args.groups * args.n, args.prompt_len, args.response_len
    ids = torch.randint(5, 1000, (rows, prompt_len + width), generator=g)
    ids[:, :prompt_len] = ids[:: args.n, :prompt_len].repeat_interleave(args.n, 0)
    mask = torch.ones_like(ids)
    response_lens = torch.randint(max(1, width // 4), width + 1, (rows,), generator=g)
    for row, length in enumerate(response_lens.tolist()):
        mask[row, prompt_len + length :] = 0
    pack = pack_shared(ids, mask, width, prompt_groups(ids, mask, width))
    row_lens = prompt_len + response_lens
    edges = [0, *row_lens.cumsum(0).tolist()]
    module = torch.nn.Module().train()

    def inputs(tokens: int) -> list[torch.Tensor]:
        shapes = ((1, heads, tokens, dim), (1, kv_heads, tokens, dim), (1, kv_heads, tokens, dim))
        return [torch.randn(*shape, generator=g).requires_grad_() for shape in shapes]

    shared_in, plain_in = inputs(pack.input_ids.shape[1]), inputs(edges[-1])
    max_keys = shared_attention.MAX_KEYS

    def shared_sdpa() -> (
        torch.Tensor
    ):  # the same grids through SDPA (engines/kernels/shared_attention.py off)
        shared_attention.MAX_KEYS = 0
        try:
            return segment_attention(module, *shared_in, None, shared_prompt=pack)[0]
        finally:
            shared_attention.MAX_KEYS = max_keys

    runs = {
        "unshared": lambda: segment_attention(module, *plain_in, None, cu_seq_lens_q=torch.tensor(edges))[0],
        "shared": lambda: segment_attention(module, *shared_in, None, shared_prompt=pack)[0],
        "shared_sdpa": shared_sdpa,
    }
    base, new, sdpa = alternate(runs, args.iters)
    print(json.dumps({
        "bench": "attention_shared_prompt", "groups": args.groups, "n": args.n, "prompt_len": prompt_len,
        "response_len_max": width, "heads": heads, "kv_heads": kv_heads, "dim": dim, "threads": args.threads,
        "shared_tokens": int(pack.input_ids.shape[1]), "unshared_tokens": edges[-1], "unshared_s": round(base, 5),
        "shared_s": round(new, 5), "ratio_shared_vs_unshared": round(new / base, 3),
        "shared_products": shared_attention.fits(shared_in[0], pack.attention, 0.0), "shared_sdpa_s": round(sdpa, 5),
        "ratio_shared_vs_shared_sdpa": round(new / sdpa, 3),
        "load_average": [round(x, 2) for x in os.getloadavg()],
    }))  # fmt: skip


if __name__ == "__main__":
    main()
