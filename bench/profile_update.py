"""Where one GRPO update's time goes on a real model: vocabulary projection, attention, MLPs, optimizer.

Builds the FSDP engine (one rank, the defaults a job gets) on a built-in model and updates it on a
GRPO-shaped batch: `--prompts` prompts of `--prompt-len` tokens, each with `--n` responses of
`--response-len` tokens (every group shares its prompt, as a job's batch does), a token-mean
policy-gradient loss, entropy computed as the job computes it. Timers:

- attention and MLP: forward and backward of every decoder layer's `self_attn` and `mlp`, timed by
  module hooks (forward: pre/post hooks; backward: full backward pre/post hooks; the attention's
  backward as the layer's less the MLP's);
- vocabulary projection + log-softmax (+ entropy): the log-prob function on a hidden-state tensor of
  the update's response-token count, forward and backward, timed alone;
- optimizer: `optimizer_step` (gradient clipping and fused AdamW);
- the rest of forward + backward (norms, embeddings, packing, autograd) is the remainder.

The matrix-product peak of the same process gives each part's FLOP/s as a fraction (bench/flops.py).
`--compare-head` also times the earlier log-prob path (activation checkpointing of a plain
log-softmax per chunk) on the same tensors, so the lever's effect is a ratio from one run.

    python bench/profile_update.py [--model smollm2-135m-instruct] [--iters 3] [--compare-head]
        [--threads N] [--max-tokens TOKENS]

Utilisation of the whole update (forward, backward, optimizer; 6 FLOPs per weight per token, the
body over each prompt once + every response token, the head over the response tokens) is given
against two peaks: the burst (`machine_peak`, best of five products at the start) and a sustained
loop of products (`--sustained-s` seconds) run right before each timed update and after the last,
each update against the mean of the loops on its two sides.

The update's CPU time (`process_s`, all threads) is reported beside its wall time: on a machine
other jobs share, CPU time at `--threads 1` is the figure that stays put.

Loops seconds away can still miss the update: on a shared host the product rate moved from 138 to
252 GFLOP/s within a minute (issue 34). `--probe-every K` then runs `--iters` more updates in which
every K-th matrix product of the update is followed by one 2048^3 product (a probe, bench/mm_probes.py),
timed apart: the probes sample the machine's product rate at the moments the update runs, and each such update is
rated against their median (`update_mfu_probed`), its time taken as its wall time less the probes'
(the timing hook's own overhead stays in it, so the rating errs low). It also gives the update's
products' rate against the probes (`products_against_probes`) and the products' share of the update
(`products_share`): the rating is their product where the update's FLOPs are its products'.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def grpo_batch(prompts: int, n: int, prompt_len: int, response_len: int, vocab: int, seed: int = 0):
    from tensordict import TensorDict

    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(10, vocab, (prompts, prompt_len), generator=g).repeat_interleave(n, 0)
    response = torch.randint(10, vocab, (prompts * n, response_len), generator=g)
    ids = torch.cat([prompt, response], 1)
    mask = torch.ones_like(ids)
    return TensorDict(
        {
            "input_ids": ids,
            "attention_mask": mask,
            "response_mask": mask[:, prompt_len:].clone(),
            "advantages": torch.randn(prompts * n, response_len, generator=g),
        },
        batch_size=[prompts * n],
    )


def pg_loss(micro, outputs, counts):
    loss = (-micro["advantages"] * outputs["log_probs"] * micro["response_mask"]).sum() / counts.tokens
    return loss, {"entropy": float((outputs["entropy"] * micro["response_mask"]).sum())}


class ModuleClock:
    """Forward and backward seconds of every module of a kind, summed over a step."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self._start: dict[tuple[int, str], float] = {}

    def watch(self, module: torch.nn.Module, kind: str) -> None:
        key = id(module)

        def start(phase):
            return lambda *_: self._start.__setitem__((key, phase), time.perf_counter()) or None

        def stop(phase):
            def hook(*_):
                self.seconds[f"{kind}_{phase}"] += time.perf_counter() - self._start.pop((key, phase))

            return hook

        module.register_forward_pre_hook(start("forward"))
        module.register_forward_hook(stop("forward"))
        module.register_full_backward_pre_hook(start("backward"))
        module.register_full_backward_hook(stop("backward"))


def checkpointed_log_probs(hidden, weight, targets, with_entropy, chunk):
    """The earlier path: each chunk a plain log-softmax under activation checkpointing."""
    from torch.utils.checkpoint import checkpoint

    def piece(h, t):
        logits = torch.nn.functional.linear(h, weight).float()
        lse = torch.logsumexp(logits, -1)
        lp = logits.gather(-1, t[:, None]).squeeze(-1) - lse
        ent = lse - (torch.softmax(logits, -1) * logits).sum(-1) if with_entropy else torch.zeros_like(lp)
        return lp, ent

    outs = [checkpoint(piece, hidden[s : s + chunk], targets[s : s + chunk], use_reentrant=False)
            for s in range(0, hidden.shape[0], chunk)]  # fmt: skip
    return torch.cat([o[0] for o in outs]), torch.cat([o[1] for o in outs])


def time_heads(fns: dict, hidden, weight, targets, iters: int) -> dict[str, float]:
    """Median forward + backward seconds of each log-prob function, alternating which runs first
    (a neighbour's load on the shared cores then falls on all alike); one warm-up round."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for i in range(iters + 1):
        for name in list(fns) if i % 2 else list(fns)[::-1]:
            h = hidden.detach().requires_grad_(True)
            w = weight.detach().requires_grad_(True)
            start = time.perf_counter()
            lp, ent = fns[name](h, w, targets)
            (lp.sum() + 0 * ent.sum()).backward()
            if i:
                times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def probed_updates(engine, batch, iters: int, every: int, threads: int, update_flops: float) -> dict:
    """Medians over `iters` updates, each with a 2048^3 product after every `every`-th of its own
    (bench/mm_probes.py; see the module docstring)."""
    from bench.mm_probes import ProductClock

    rows = []
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    clock = ProductClock(every).install()
    try:
        for _ in range(iters):
            clock.reset()
            with engine.train_mode():
                start = time.perf_counter()
                engine.forward_backward_batch(batch, pg_loss, compute_entropy=True)
                engine.optimizer_step()
                wall = time.perf_counter() - start
            peak = statistics.median(clock.rates)
            update_s = wall - clock.probe_s
            rows.append({
                "probed_update_s": update_s,
                "probe_gflops": peak / 1e9,
                "update_mfu_probed": update_flops / update_s / peak,
                "products_against_probes": clock.product_flops / clock.product_s / peak,
                "products_share": clock.product_s / update_s,
            })  # fmt: skip
    finally:
        clock.remove()
        torch.set_num_threads(previous)
    out = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    out["update_mfu_probed_each"] = [round(r["update_mfu_probed"], 4) for r in rows]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=36)
    parser.add_argument("--response-len", type=int, default=16)
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--compare-head", action="store_true")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: the physical cores)")
    parser.add_argument(
        "--sustained-s", type=float, default=3.0, help="seconds of the matmul loop around each update"
    )
    parser.add_argument(
        "--max-tokens", type=int, default=0, help="max_tokens_per_micro_batch (0: the automatic budget)"
    )
    parser.add_argument(
        "--probe-every", type=int, default=0, help="also rate updates against probes among their products"
    )
    args = parser.parse_args()
    from bench.flops import machine_peak, model_shape, sustained_matmul_flops
    from bench.flops import update_flops as flops_of_update
    from controller.models import builtin_model_path
    from engines.host_memory import keep_freed_memory, minor_page_faults
    from engines.kernels.logprobs import token_log_probs
    from engines.threads import physical_cores, set_torch_threads
    from engines.training.fsdp.engine import FSDPEngine
    from schema.engine import EngineConfig, MicroBatchConfig

    threads = set_torch_threads(args.threads or physical_cores())
    keep_freed_memory()  # as a job's worker process does (controller/worker_group.py)
    peak = machine_peak(threads)
    model_dir = str(builtin_model_path(args.model))
    os.environ.update({"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29633"})
    micro = MicroBatchConfig(max_tokens_per_micro_batch=args.max_tokens or None)
    engine = FSDPEngine(EngineConfig(model_path=model_dir, optim={"lr": 1e-6}, micro_batch=micro))
    engine.initialize()
    clock = ModuleClock()
    for layer in engine.model.lm.model.layers:
        clock.watch(layer, "layer")  # takes its hidden states positionally: its backward hooks fire
        clock.watch(layer.self_attn, "attention")
        clock.watch(layer.mlp, "mlp")
    vocab = engine.hf_config.vocab_size
    batch = grpo_batch(args.prompts, args.n, args.prompt_len, args.response_len, vocab)
    rows = []
    sustained = []  # the matmul loop's rate before each timed update and after the last
    for i in range(args.iters + 1):  # the first is warm-up
        if i:
            sustained.append(sustained_matmul_flops(threads, args.sustained_s))
        clock.seconds.clear()
        with engine.train_mode():
            start, cpu, faults = time.perf_counter(), time.process_time(), minor_page_faults()
            engine.forward_backward_batch(batch, pg_loss, compute_entropy=True)
            middle = time.perf_counter()
            engine.optimizer_step()
            end = time.perf_counter()
        if i:
            process_s = time.process_time() - cpu
            rows.append({"forward_backward_s": middle - start, "optimizer_s": end - middle,
                         "process_s": process_s, "minor_page_faults": minor_page_faults() - faults,
                         **clock.seconds})  # fmt: skip
    sustained.append(sustained_matmul_flops(threads, args.sustained_s))
    shape = model_shape(model_dir)
    body_tokens = args.prompts * (args.prompt_len + args.n * args.response_len)
    tokens = args.prompts * args.n * args.response_len
    update_flops = sum(flops_of_update(shape, args.prompts * args.prompt_len, tokens))
    for row, before, after in zip(rows, sustained, sustained[1:], strict=False):
        update_s = row["forward_backward_s"] + row["optimizer_s"]
        row["update_gflops"] = update_flops / update_s / 1e9
        row["update_mfu_burst"] = update_flops / update_s / peak["matmul_flops"]
        row["update_mfu_sustained"] = update_flops / update_s / ((before + after) / 2)
    step = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    step["update_tflop"] = update_flops / 1e12
    width = engine.hf_config.hidden_size
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(tokens, width, generator=g)
    targets = torch.randint(0, vocab, (tokens,), generator=g)
    weight = engine.model.lm.get_output_embeddings().weight
    chunk = engine.config.logprob_chunk_tokens
    heads = {"head_s": lambda h, w, t: token_log_probs(h, w, t, 1.0, True, chunk)}
    if args.compare_head:
        heads["head_checkpointed_s"] = lambda h, w, t: checkpointed_log_probs(h, w, t, True, chunk)
    step.update(time_heads(heads, hidden, weight, targets, args.iters))
    # The attention takes its inputs as keywords, so its own backward hooks see no input gradient:
    # its backward is the layer's less the MLP's (the two norms and residual adds included).
    step["attention_backward"] = step["layer_backward"] - step["mlp_backward"]
    parts = ("layer_forward", "layer_backward", "head_s")
    step["other_forward_backward_s"] = step["forward_backward_s"] - sum(step.get(k, 0.0) for k in parts)
    head_flops = 4 * 2 * shape["head_params"] * tokens  # forward, recompute, two gradient products
    step["head_gflops"] = head_flops / step["head_s"] / 1e9
    mlp_params = sum(p.numel() for layer in engine.model.lm.model.layers for p in layer.mlp.parameters())
    step["mlp_gflops"] = 6 * mlp_params * body_tokens / (step["mlp_forward"] + step["mlp_backward"]) / 1e9
    if args.probe_every:
        step.update(probed_updates(engine, batch, args.iters, args.probe_every, threads, update_flops))
    line = {"bench": "profile_update", "model": args.model, "threads": threads, "response_tokens": tokens,
            "peak_matmul_gflops": peak["matmul_flops"] / 1e9,
            "sustained_matmul_gflops": [round(f / 1e9, 1) for f in sustained],
            "load_average": os.getloadavg(),
            **{k: round(v, 4) if isinstance(v, float) else v for k, v in step.items()}}  # fmt: skip
    print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
