"""Many LoRA sessions on one SessionWorker against one process (one base copy) per session.

For N = 1, 2, 4, 8: (shared) one child process hosting N sessions, each step one `forward_backward` of N
forward_backward ops (one multi-adapter forward) and N optim_steps; (separate) N child processes at
once, each a SessionWorker with one session (its own copy of the base, as N single-model RL jobs have).
Each child reports its resident memory (RSS after the steps, and peak) and the forward_backward
tokens it computed and the seconds they took; the separate runs add RSS over processes and divide
all their tokens by the wall time of the slowest. Baseline, measured in the same run: one session
running an N-times batch (N = 4: the goal's "4x batch"). One JSON line per configuration, then one
of ratios: memory of N = 4 sessions / one session's host (goal <= 1.5), aggregate tokens/s of N = 4
sessions / one session with a 4x batch (goal >= 0.8), and the same memory ratio for separate hosts.

    PYTHONPATH=$PWD .venv/bin/python bench/sessions.py [--model qwen2-20m] [--counts 1,2,4,8] [--quick] [--paired]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def child(args: argparse.Namespace) -> None:
    import torch

    from workers.session_host import SessionWorker

    host = SessionWorker(
        args.model_path,
        args.workdir,
        {"max_resident_adapters": 16, "max_batch_tokens": args.max_batch_tokens},
    )
    ids = [f"s{i}" for i in range(args.sessions)]
    for i, m in enumerate(ids):
        host.create_adapter(m, args.rank, seed=i)
    g = torch.Generator().manual_seed(0)
    n = args.seq_len

    def datum() -> dict:
        toks = torch.randint(10, host.engine.vocab, (n + 1,), generator=g).tolist()
        ones = {"data": [1.0] * n, "dtype": "float32", "shape": [n]}
        return {
            "tokens": toks[:-1],
            "loss_fn_inputs": {
                "target_tokens": {"data": toks[1:], "dtype": "int64", "shape": [n]},
                "weights": ones,
            },
        }

    data = {m: [datum() for _ in range(args.rows)] for m in ids}
    fb = [{"adapter": m, "data": data[m], "loss_fn": "cross_entropy", "backward": True} for m in ids]
    seconds = 0.0
    for i in range(args.warmup + args.steps):
        start = time.perf_counter()
        results = host.forward_backward_calls(fb)
        if i >= args.warmup:
            seconds += time.perf_counter() - start
        assert all("ok" in r for r in results), results
        for m in ids:
            host.optim_step({"learning_rate": 1e-4}, m)
    tokens = args.steps * args.sessions * args.rows * n
    print(
        json.dumps(
            {
                "rss_bytes": host.describe()["rss_bytes"],
                "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                "tokens": tokens,
                "seconds": seconds,
                "base_loads": host.describe()["base_loads"],
            }
        )
    )


def paired(args: argparse.Namespace, model_path: Path) -> dict:
    """Throughput only, robust to a neighbour's load that drifts between configurations: one process
    holds host A (4 sessions x rows) and host B (1 session x 4 rows), and alternates one timed
    forward_backward round on each, `steps` times; medians and their ratio."""
    import statistics

    from workers.session_host import SessionWorker

    def setup(sessions: int, rows: int, seed: int):
        host = SessionWorker(str(model_path), tempfile.mkdtemp(prefix="bench-paired-"), {})
        ids = [f"s{i}" for i in range(sessions)]
        for i, m in enumerate(ids):
            host.create_adapter(m, args.rank, seed=i)
        g = torch.Generator().manual_seed(seed)
        n = args.seq_len
        ops = []
        for m in ids:
            data = []
            for _ in range(rows):
                toks = torch.randint(10, host.engine.vocab, (n + 1,), generator=g).tolist()
                inputs = {
                    "target_tokens": {"data": toks[1:], "dtype": "int64", "shape": [n]},
                    "weights": {"data": [1.0] * n, "dtype": "float32", "shape": [n]},
                }
                data.append({"tokens": toks[:-1], "loss_fn_inputs": inputs})
            ops.append({"adapter": m, "data": data, "loss_fn": "cross_entropy", "backward": True})
        return host, ops

    import torch

    pairs = {"4_sessions": setup(4, args.rows, 0), "1_session_4x_batch": setup(1, 4 * args.rows, 0)}
    times: dict[str, list[float]] = {k: [] for k in pairs}
    for i in range(args.warmup + args.steps):
        for name in list(pairs) if i % 2 == 0 else list(reversed(pairs)):
            host, ops = pairs[name]
            start = time.perf_counter()
            assert all("ok" in r for r in host.forward_backward_calls(ops))
            if i >= args.warmup:
                times[name].append(time.perf_counter() - start)
    tokens = 4 * args.rows * args.seq_len
    med = {k: statistics.median(v) for k, v in times.items()}
    return {
        "mode": "paired",
        "model": args.model,
        "threads": torch.get_num_threads(),
        **{f"{k}_fb_tokens_per_s": round(tokens / v, 1) for k, v in med.items()},
        "throughput_4_sessions_vs_4x_batch": round(med["1_session_4x_batch"] / med["4_sessions"], 3),
        "load_average": os.getloadavg(),
    }


def run_children(args: argparse.Namespace, model_path: Path, sessions: int, rows: int, copies: int) -> dict:
    env = {
        **os.environ,
        "PYTHONPATH": str(Path(__file__).resolve().parents[1]),
        "TOKENIZERS_PARALLELISM": "false",
    }
    procs, start = [], time.perf_counter()
    for _ in range(copies):
        workdir = tempfile.mkdtemp(prefix="bench-sessions-")
        cmd = [sys.executable, __file__, "--child", "--model", args.model, "--model-path", str(model_path)]
        cmd += [
            "--workdir",
            workdir,
            "--sessions",
            str(sessions),
            "--rows",
            str(rows),
            "--rank",
            str(args.rank),
        ]
        cmd += ["--seq-len", str(args.seq_len), "--steps", str(args.steps), "--warmup", str(args.warmup)]
        cmd += ["--max-batch-tokens", str(args.max_batch_tokens)]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True))
    outs = []
    for p in procs:
        out, _ = p.communicate(timeout=1800)
        if p.returncode != 0:
            raise RuntimeError(f"bench child failed (rc {p.returncode})")
        outs.append(json.loads(out.strip().splitlines()[-1]))
    wall = time.perf_counter() - start
    tokens = sum(o["tokens"] for o in outs)
    return {
        "rss_bytes": sum(o["rss_bytes"] for o in outs),
        "peak_rss_bytes": sum(o["peak_rss_bytes"] for o in outs),
        "fb_tokens_per_s": tokens / max(o["seconds"] for o in outs),
        "base_loads": sum(o["base_loads"] for o in outs),
        "wall_s": round(wall, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="qwen2-20m")
    parser.add_argument("--quick", action="store_true", help="qwen2-1m, fewer steps, N up to 4")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--rows", type=int, default=4, help="rows per session per forward_backward")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument(
        "--counts", default="1,2,4,8", help="the session counts N to measure (1 and 4 needed)"
    )
    parser.add_argument("--max-batch-tokens", type=int, default=16384, help="the host's forward token budget")
    parser.add_argument(
        "--paired", action="store_true", help="only the alternating in-process throughput A/B"
    )
    parser.add_argument("--child", action="store_true")
    parser.add_argument("--model-path")
    parser.add_argument("--workdir")
    parser.add_argument("--sessions", type=int, default=1)
    args = parser.parse_args()
    if args.child:
        return child(args)
    from engines.models.tiny_models import build_builtin_model

    if args.quick:
        args.model, args.steps, args.seq_len = "qwen2-1m", 3, 64
    model_path = build_builtin_model(args.model, Path(tempfile.gettempdir()) / "tandem-bench-models")
    if args.paired:
        print(json.dumps(paired(args, model_path)), flush=True)
        return
    counts = (1, 2, 4) if args.quick else tuple(int(c) for c in args.counts.split(","))
    lines: dict[tuple[str, int], dict] = {}
    for n in counts:
        for mode, sessions, rows, copies in (("shared", n, args.rows, 1), ("separate", 1, args.rows, n)):
            if mode == "separate" and n == 1:
                lines[(mode, n)] = lines[("shared", 1)]
                continue
            res = run_children(args, model_path, sessions, rows, copies)
            lines[(mode, n)] = res
            print(
                json.dumps(
                    {"mode": mode, "sessions": n, "rows_per_session": rows, "model": args.model, **res}
                ),
                flush=True,
            )
    big = run_children(args, model_path, 1, args.rows * 4, 1)
    print(
        json.dumps(
            {
                "mode": "one_session_4x_batch",
                "sessions": 1,
                "rows_per_session": args.rows * 4,
                "model": args.model,
                **big,
            }
        ),
        flush=True,
    )
    one, four, sep4 = lines[("shared", 1)], lines[("shared", 4)], lines[("separate", 4)]
    ratios = {
        "memory_4_sessions_vs_1": round(four["rss_bytes"] / one["rss_bytes"], 3),
        "memory_4_separate_vs_1": round(sep4["rss_bytes"] / one["rss_bytes"], 3),
        "throughput_4_sessions_vs_4x_batch": round(four["fb_tokens_per_s"] / big["fb_tokens_per_s"], 3),
        "throughput_4_sessions_vs_4_separate": round(four["fb_tokens_per_s"] / sep4["fb_tokens_per_s"], 3),
        "load_average": os.getloadavg(),
    }
    print(
        json.dumps({"ratios": ratios, "model": args.model, "max_batch_tokens": args.max_batch_tokens}),
        flush=True,
    )


if __name__ == "__main__":
    main()
