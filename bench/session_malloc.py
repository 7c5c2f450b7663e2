"""A Tinker session host's process with the ranks' malloc setup against one without it.

A SessionWorker (workers/session_host.py) in a process where malloc keeps freed memory and maps with
transparent huge pages (engines/host_memory.py: `keep_freed_memory`, and `malloc_tunables` in the
process's GLIBC_TUNABLES, as service/tinker_hosts.py starts its host actors) against one in a plain
process (glibc's defaults, as host actors had before). Each configuration is a child process, rounds
alternating the order; each child builds a host, creates one LoRA session (rank 16) and times
`--steps` rounds of forward_backward (cross-entropy, `--rows` rows of `--seq-len` tokens) plus
optim_step after one warm-up round, counting minor page faults. One JSON line per child, then a
summary with the ratio of the medians (kept / plain).

    .venv/bin/python bench/session_malloc.py [--model smollm2-135m-instruct] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def child(args: argparse.Namespace) -> None:
    from engines.host_memory import keep_freed_memory, minor_page_faults

    kept = keep_freed_memory() if args.kept else False
    import torch

    from controller.models import builtin_model_path
    from workers.session_host import SessionWorker

    host = SessionWorker(str(builtin_model_path(args.model)), tempfile.mkdtemp(), {"threads": 2})
    host.create_adapter("s0", 16, seed=0)
    g, n = torch.Generator().manual_seed(0), args.seq_len
    data = []
    for _ in range(args.rows):
        toks = torch.randint(10, host.engine.vocab, (n + 1,), generator=g).tolist()
        inputs = {
            "target_tokens": {"data": toks[1:], "dtype": "int64", "shape": [n]},
            "weights": {"data": [1.0] * n, "dtype": "float32", "shape": [n]},
        }
        data.append({"tokens": toks[:-1], "loss_fn_inputs": inputs})
    fb = [{"adapter": "s0", "data": data, "loss_fn": "cross_entropy", "backward": True}]
    seconds, faults = [], 0
    for i in range(1 + args.steps):
        before, start = minor_page_faults(), time.perf_counter()
        results = host.forward_backward_calls(fb)
        host.optim_step({"learning_rate": 1e-4}, "s0")
        if i:  # the first round is a warm-up
            seconds.append(time.perf_counter() - start)
            faults += minor_page_faults() - before
        assert all("ok" in r for r in results), results
    print(json.dumps({"kept": args.kept, "keeps_freed_memory": kept, "step_s_median": statistics.median(seconds),
                      "faults_per_step": round(faults / args.steps)}))  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--kept", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    from engines.host_memory import malloc_tunables

    rows = []
    for r in range(args.rounds):
        for kept in (True, False) if r % 2 == 0 else (False, True):
            env = {**os.environ, "PYTHONPATH": str(ROOT), "TOKENIZERS_PARALLELISM": "false"}
            env.pop("GLIBC_TUNABLES", None)
            if kept:
                env["GLIBC_TUNABLES"] = malloc_tunables(None)
            command = [sys.executable, __file__, "--child", "--model", args.model, "--steps", str(args.steps),
                       "--rows", str(args.rows), "--seq-len", str(args.seq_len)] + (["--kept"] if kept else [])  # fmt: skip
            done = subprocess.run(command, capture_output=True, text=True, env=env, check=False)
            lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
            if done.returncode or not lines:
                raise RuntimeError(f"the child failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
            row = {"bench": "session_malloc", "model": args.model, "round": r, **json.loads(lines[-1])}
            rows.append(row)
            print(json.dumps(row), flush=True)
    kept_s = statistics.median(r["step_s_median"] for r in rows if r["kept"])
    plain_s = statistics.median(r["step_s_median"] for r in rows if not r["kept"])
    print(json.dumps({"bench": "session_malloc", "summary": True, "model": args.model, "rounds": args.rounds,
                      "step_s_kept_plain": [round(kept_s, 3), round(plain_s, 3)], "ratio": round(kept_s / plain_s, 3),
                      "loadavg_1m": round(os.getloadavg()[0], 2)}))  # fmt: skip


if __name__ == "__main__":
    main()
