"""Where a GRPO step's generation goes on a real model, part by part, against what the machine can do.

One process, the shape of issue 34's step: 16 arithmetic prompts through the model's chat template
(~36 tokens on SmolLM2), 8 samples each, 16 new tokens, temperature 1. The variants run
alternately (each timed `--repeats` times after a short warm-up) so the load of the shared cores
falls on all of them alike:

- `fused`: the hf engine as a job gets it (engines/rollout/hf.py: fused decode step, inverse-CDF
  sampling);
- `transformers`: the same engine with each decode step through transformers' forward;
- `multinomial`: the same engine with the sampler it had before (softmax + `torch.multinomial`);
- `vllm` (where vllm is installed; `--no-vllm` leaves it out): the vLLM engine on the same prompts;
- `plain_generate` (`--plain`): transformers' own `model.generate`, the reference loop.

Each hf run is split into parts by timing the engine's own calls (process CPU time and wall time):
`prefill` (`_prefill`: the distinct prompts, their cache copied to the samples), `decode_layers`
(a decode step less the two parts below), `lm_head`, `kv_cache` (`PreallocatedLayer.update`
inside decode steps), `sampling` (`sample_next`), and `loop` (the rest: bookkeeping, row drops).
Every part is set beside its bound at the matmul peak and read bandwidth measured in this process
(bench/flops.py) at the same thread count, before and after every round (the best of them): FLOPs / peak + bytes / bandwidth, with the weights read
once per decode step, the logits read once per sampling, the new keys/values written once.

A weight sync of the whole model (what a colocated job does before every step's generation) is timed
for the hf and the vLLM engine: `update_weights` of every tensor, then `finish_update`.

    PYTHONPATH=$PWD .venv/bin/python bench/generation.py [--model smollm2-135m-instruct] [--threads 2]
        [--repeats 2] [--no-vllm] [--plain]

Prints one JSON line per (variant, repeat), then one summary line (best of the repeats per part,
ratios to `fused`, each part against its bound, the load average before and after).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.flops import machine_peak, model_shape  # noqa: E402
from engines.rollout import hf as hf_module  # noqa: E402
from engines.rollout.base import SamplingParams  # noqa: E402
from engines.rollout.fused_decode import PreallocatedLayer  # noqa: E402
from engines.rollout.sampling import filter_logits  # noqa: E402


def chat_prompts(model_dir: Path, count: int) -> list[list[int]]:
    """The arithmetic task's first `count` train prompts, rendered as Tandem renders them."""
    from transformers import AutoTokenizer

    from controller.tasks import write_splits
    from controller.tasks.arithmetic import ArithmeticTask

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    with tempfile.TemporaryDirectory() as folder:
        train, _ = write_splits(ArithmeticTask(), folder, train_size=count, val_size=1, seed=0)
        rows = [json.loads(line) for line in Path(train).read_text().splitlines()]
    texts = [
        tokenizer.apply_chat_template([{"role": "user", "content": r["prompt"]}], add_generation_prompt=True, tokenize=False)
        if getattr(tokenizer, "chat_template", None) else r["prompt"]
        for r in rows
    ]  # fmt: skip
    return tokenizer(texts, add_special_tokens=False)["input_ids"]


def multinomial_sample_next(logits, params, generator):
    """The hf engine's sampler before issue 34 (kept here as the baseline it is measured against)."""
    temperature = params.temperature if params.temperature > 0 else 1.0
    scaled = filter_logits(logits.float() / temperature, params.top_k, params.top_p)
    log_probs = scaled.log_softmax(dim=-1)
    if params.temperature == 0:
        tokens = scaled.argmax(dim=-1)
    else:
        tokens = torch.multinomial(log_probs.exp(), 1, generator=generator).squeeze(-1)
    return tokens, log_probs.gather(-1, tokens[:, None]).squeeze(-1)


class Parts:
    """Process CPU seconds and wall seconds of the engine's parts during one generate (see the module
    docstring). Wraps the engine's methods in place; `close` puts them back."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.cpu: dict[str, float] = defaultdict(float)
        self.wall: dict[str, float] = defaultdict(float)
        self.decode_rows: list[int] = []
        self.in_step = False
        self._saved = {
            "prefill": engine._prefill,
            "step": engine._step,
            "sample": hf_module.sample_next,
            "update": PreallocatedLayer.update,
        }
        self.sampler = hf_module.sample_next
        timed = self._timed
        engine._prefill = timed("prefill", self._saved["prefill"])
        engine._step = self._step
        hf_module.sample_next = lambda *a: timed("sampling", self.sampler)(*a)
        original_update = self._saved["update"]

        def update(layer, *args, **kwargs):
            if not self.in_step:
                return original_update(layer, *args, **kwargs)
            return timed("kv_cache", original_update)(layer, *args, **kwargs)

        PreallocatedLayer.update = update
        head = engine.model.lm_head
        self._hooks = [
            head.register_forward_pre_hook(lambda *_: self._start("lm_head")),
            head.register_forward_hook(lambda *_: self._stop("lm_head")),
        ]
        self._open: dict[str, tuple[float, float]] = {}

    def _start(self, name: str) -> None:
        if self.in_step:
            self._open[name] = (time.process_time(), time.perf_counter())

    def _stop(self, name: str) -> None:
        if self.in_step and name in self._open:
            cpu, wall = self._open.pop(name)
            self.cpu[name] += time.process_time() - cpu
            self.wall[name] += time.perf_counter() - wall

    def _timed(self, name: str, fn):
        def run(*args, **kwargs):
            cpu, wall = time.process_time(), time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.cpu[name] += time.process_time() - cpu
                self.wall[name] += time.perf_counter() - wall

        return run

    def _step(self, tokens, *args):
        self.decode_rows.append(tokens.shape[0])
        self.in_step = True
        try:
            return self._timed("decode_step", self._saved["step"])(tokens, *args)
        finally:
            self.in_step = False

    def reset(self) -> None:
        self.cpu.clear()
        self.wall.clear()
        self.decode_rows = []

    def split(self, total_cpu: float, total_wall: float) -> dict[str, dict[str, float]]:
        """{part: {'cpu_s', 'wall_s'}}: decode_layers is the step less lm_head and kv_cache, loop the rest."""
        out = {}
        for kind, parts, total in (("cpu_s", self.cpu, total_cpu), ("wall_s", self.wall, total_wall)):
            layers = parts["decode_step"] - parts["lm_head"] - parts["kv_cache"]
            named = {
                "prefill": parts["prefill"],
                "decode_layers": layers,
                "lm_head": parts["lm_head"],
                "kv_cache": parts["kv_cache"],
                "sampling": parts["sampling"],
            }
            named["loop"] = total - sum(named.values())
            named["total"] = total
            for part, seconds in named.items():
                out.setdefault(part, {})[kind] = round(seconds, 4)
        return out

    def close(self) -> None:
        self.engine._prefill = self._saved["prefill"]
        self.engine._step = self._saved["step"]
        hf_module.sample_next = self._saved["sample"]
        PreallocatedLayer.update = self._saved["update"]
        for hook in self._hooks:
            hook.remove()


def bounds(
    shape: dict, config, peak: dict, distinct: int, width: int, batch: int, decode_rows: list[int]
) -> dict[str, float]:  # fmt: skip
    """Seconds each part needs at the measured matmul peak and read bandwidth (module docstring)."""
    flops, bandwidth = peak["matmul_flops"], peak["read_bytes_per_s"]
    body, head = shape["body_params"], shape["head_params"]
    fed = sum(decode_rows)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv_bytes = 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * 4
    sampled_rows = batch + fed  # the prefill's logits, then each decode step's
    out = {
        "prefill": (2 * body * distinct * width + 2 * head * distinct) / flops
        + 4 * (body + head) / bandwidth,
        "decode_layers": 2 * body * fed / flops + 4 * body * len(decode_rows) / bandwidth,
        "lm_head": 2 * head * fed / flops + 4 * head * len(decode_rows) / bandwidth,
        "kv_cache": kv_bytes * fed / bandwidth,
        "sampling": 4 * config.vocab_size * sampled_rows / bandwidth,
    }
    out["loop"] = 0.0
    out["total"] = sum(out.values())
    return {k: round(v, 4) for k, v in out.items()}


def weight_sync_seconds(engine, tensors: list[tuple[str, torch.Tensor]]) -> float:
    start = time.perf_counter()
    engine.update_weights(iter(tensors))
    engine.finish_update()
    return time.perf_counter() - start


def lora_merge_seconds(engine, rank: int) -> float:
    """One LoRA sync into the hf engine: a random rank-`rank` adapter on every linear layer of the
    decoder, merged into the weights (`AdapterMerger`, engines/rollout/hf.py), then `finish_update`."""
    generator = torch.Generator().manual_seed(0)
    tensors = []
    for name, module in engine.model.model.layers.named_modules():
        if isinstance(module, torch.nn.Linear):
            prefix = f"base_model.model.model.layers.{name}"
            tensors.append(
                (f"{prefix}.lora_A.weight", torch.randn(rank, module.in_features, generator=generator))
            )
            tensors.append((f"{prefix}.lora_B.weight", torch.zeros(module.out_features, rank)))
    start = time.perf_counter()
    engine.load_adapter({"r": rank, "lora_alpha": 2 * rank}, tensors)
    engine.finish_update()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct", help="a built-in name or a model folder")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument(
        "--variants", default="fused,transformers,multinomial", help="hf variants, comma-separated"
    )
    parser.add_argument("--no-vllm", dest="vllm", action="store_false")
    parser.add_argument("--plain", action="store_true", help="also time transformers' model.generate")
    parser.add_argument(
        "--also-threads", type=int, help="also run each hf variant at this thread count (as NAME@Nt)"
    )
    args = parser.parse_args()

    from controller.models import builtin_model_path
    from engines.rollout import available_backends, build_rollout_engine
    from engines.rollout.hf import HFRolloutEngine, left_pad

    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()[0]
    folder = Path(args.model) if Path(args.model).is_dir() else builtin_model_path(args.model)
    prompts = chat_prompts(folder, args.prompts)
    engine = HFRolloutEngine(folder)
    shape, config = model_shape(folder), engine.model.config
    params = SamplingParams(max_new_tokens=args.new_tokens, temperature=1.0, n=args.n, seed=0)
    warm = params.model_copy(update={"max_new_tokens": 2})
    peak = machine_peak(args.threads)
    fused = engine._fused
    parts = Parts(engine)

    def hf_variant(name: str, threads: int = args.threads):
        def run(p: SamplingParams):
            engine._fused = None if name == "transformers" else fused
            parts.sampler = multinomial_sample_next if name == "multinomial" else parts._saved["sample"]
            torch.set_num_threads(threads)
            try:
                return engine.generate(prompts, p)
            finally:
                torch.set_num_threads(args.threads)

        return run

    hf_names = args.variants.split(",")
    runs = {name: hf_variant(name) for name in hf_names}
    if args.also_threads:
        hf_names += [f"{name}@{args.also_threads}t" for name in hf_names]
        runs.update({f"{name}@{args.also_threads}t": hf_variant(name, args.also_threads) for name in runs})
    vllm = None
    if args.vllm and available_backends()["vllm"] is None:
        longest = max(len(p) for p in prompts)
        vllm = build_rollout_engine("vllm", folder, max_model_len=longest + args.new_tokens + 8)
        torch.set_num_threads(args.threads)
        runs["vllm"] = lambda p: vllm.generate(prompts, p)
    if args.plain:
        ids, mask = left_pad([p for p in prompts for _ in range(args.n)], engine.pad_token_id, engine.device)

        def plain(p: SamplingParams):
            with torch.inference_mode():
                out = engine.model.generate(
                    input_ids=ids, attention_mask=mask, max_new_tokens=p.max_new_tokens, do_sample=True,
                    top_k=None, top_p=None, pad_token_id=engine.pad_token_id, eos_token_id=engine.eos_token_ids,
                )  # fmt: skip
            return out[:, ids.shape[1] :]

        runs["plain_generate"] = plain
    for run in runs.values():  # warm-up: every path once, two tokens
        run(warm)
    results: dict[str, list[dict]] = defaultdict(list)
    for repeat in range(args.repeats):
        for name, run in runs.items():
            parts.reset()
            cpu, wall = time.process_time(), time.perf_counter()
            out = run(params)
            cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
            tokens = int(out.numel()) if isinstance(out, torch.Tensor) else sum(len(c.token_ids) for c in out)
            line = {"variant": name, "repeat": repeat, "cpu_s": round(cpu, 3), "wall_s": round(wall, 3)}
            line.update(tokens=tokens, load_avg_1m=round(os.getloadavg()[0], 2))
            if name in hf_names:
                line["parts"] = parts.split(cpu, wall)
                line["decode_rows"] = list(parts.decode_rows)
            results[name].append(line)
            print(json.dumps({"bench": "generation", **line}), flush=True)
        # The peaks again after every round: the best seen is the bound (a busy moment lowers them).
        again = machine_peak(args.threads)
        peak = {k: max(v, again[k]) for k, v in peak.items()}
    parts.close()
    engine._fused = fused

    tensors = [(k, v.detach().clone()) for k, v in engine.model.state_dict().items()]
    syncs = {"hf": min(weight_sync_seconds(engine, tensors) for _ in range(2))}
    syncs["hf_lora16_merge"] = min(lora_merge_seconds(engine, rank=16) for _ in range(2))
    if vllm is not None:
        syncs["vllm"] = min(weight_sync_seconds(vllm, tensors) for _ in range(2))
        vllm.shutdown()

    best = {name: min(lines, key=lambda line: line["cpu_s"]) for name, lines in results.items()}
    reference = best[next(iter(best))]
    rows = reference.get("decode_rows", [])
    width = max(len(p) for p in prompts)
    bound = bounds(shape, config, peak, len(prompts), width, len(prompts) * args.n, rows)
    summary = {
        "bench": "generation_summary",
        "model": args.model,
        "shape": {
            "prompts": len(prompts),
            "n": args.n,
            "new_tokens": args.new_tokens,
            "prompt_tokens": width,
        },
        "threads": args.threads,
        "peak_matmul_gflops": round(peak["matmul_flops"] / 1e9, 1),
        "peak_read_gb_per_s": round(peak["read_bytes_per_s"] / 1e9, 1),
        "bound_s": bound,
        "best_cpu_s": {name: line["cpu_s"] for name, line in best.items()},
        "best_wall_s": {name: min(x["wall_s"] for x in results[name]) for name in results},
        "cpu_vs_first": {name: round(line["cpu_s"] / reference["cpu_s"], 3) for name, line in best.items()},
        "weight_sync_s": {k: round(v, 3) for k, v in syncs.items()},
        "load_avg_1m": [round(load_before, 2), round(os.getloadavg()[0], 2)],
    }
    for name, line in best.items():
        if "parts" in line:
            summary[f"parts_{name}"] = {
                part: {**times, "of_bound": round(bound[part] / times["wall_s"], 3) if times["wall_s"] > 0 and "@" not in name else None}
                for part, times in line["parts"].items()
            }  # fmt: skip
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
