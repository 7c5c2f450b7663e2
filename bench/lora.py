"""LoRA against full fine-tuning in one run: memory, update time, weight-sync bytes and time.

For each mode (full weights, LoRA) one child process builds the FSDP engine (world size 1) and an hf
rollout engine beside it, as the hybrid worker does, then measures:

- the training state it holds: parameters, gradients and Adam moments, in bytes (exact), and the
  process's peak RSS (the high-water mark of everything: model, rollout copy, activations);
- an update: `forward_backward_batch` + `optimizer_step` on one batch (rows x prompt + response
  tokens, token-mean policy-gradient loss), the median of the timed repeats;
- a weight sync into the rollout engine: `InProcessTransfer` (full) or `AdapterTransfer` (LoRA; its probe is
  timed apart), bytes moved and seconds, median of the repeats.

Last, PEFT's LoRA layer against a minimal own one (`layer_cost`): the reason to use PEFT or not.
The LoRA child also measures the two ways the hf engine can serve an adapter (engines/rollout/
hf.py): generation with the adapter merged into its weights (fused decode) against the
same generation with PEFT's LoRA layers in its forward (transformers' forward), and the base engine
without the fused step, which separates the two effects. One JSON line per mode and one of ratios
(LoRA / full, measured in this run); progress to stderr. The modes run one after the other, so a
neighbour's load on shared cores can fall on one more than the other: record the load average.

    .venv/bin/python bench/lora.py [--model qwen2-20m] [--rank 16] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def batch(rows: int, prompt: int, response: int, vocab: int, seed: int):
    from tensordict import TensorDict

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(10, vocab, (rows, prompt + response), generator=g)
    mask = torch.ones_like(ids)
    return TensorDict(
        {
            "input_ids": ids,
            "attention_mask": mask,
            "response_mask": mask[:, prompt:].clone(),
            "advantages": torch.randn(rows, response, generator=g),
        },
        batch_size=[rows],
    )


def pg_loss(micro, outputs, counts):
    loss = (-micro["advantages"] * outputs["log_probs"] * micro["response_mask"]).sum() / counts.tokens
    return loss, {}


def median_seconds(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def child(args: argparse.Namespace) -> dict:
    from engines.rollout.base import SamplingParams
    from engines.rollout.hf import HFRolloutEngine
    from engines.training.fsdp.engine import FSDPEngine
    from engines.transfer.adapter import AdapterTransfer, probe_difference, probe_sequence
    from engines.transfer.in_process import InProcessTransfer
    from schema.engine import EngineConfig

    torch.set_num_threads(args.threads)
    os.environ.update(
        {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(args.port)}
    )
    lora = {"rank": args.rank, "alpha": 2.0 * args.rank} if args.mode == "lora" else None
    engine = FSDPEngine(EngineConfig(model_path=args.model_dir, lora=lora, optim={"lr": 1e-4}))
    engine.initialize()
    vocab = engine.hf_config.vocab_size
    data = [batch(args.rows, args.prompt, args.response, vocab, seed) for seed in range(args.iters + 1)]
    steps = iter(data)

    def update() -> None:
        with engine.train_mode():
            engine.forward_backward_batch(next(steps), pg_loss)
            engine.optimizer_step()

    update()  # warm-up; also creates the Adam moments
    update_s = median_seconds(update, args.iters)
    params = list(engine.model.parameters())
    trainable = [p for p in params if p.requires_grad]
    moments = [v for state in engine.optimizer.state.values() for v in state.values()]
    rollout = HFRolloutEngine(args.model_dir, device="cpu", dtype="float32")
    sync = (
        AdapterTransfer(engine, rollout, probe_tolerance=1e-3)
        if lora
        else InProcessTransfer(rollout, bucket_mb=512)
    )
    syncs = []
    for _ in range(args.iters):
        with engine.eval_mode():
            syncs.append(sync.transfer(engine.get_per_tensor_param()))
    line = {
        "mode": args.mode,
        "model": args.model,
        "rank": args.rank if lora else None,
        "parameters": sum(p.numel() for p in params),
        "trainable_parameters": sum(p.numel() for p in trainable),
        "state_bytes": tensor_bytes(params) + tensor_bytes(trainable) + tensor_bytes(moments),
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "update_s": update_s,
        "sync_bytes": syncs[-1].bytes,
        "sync_s": statistics.median(s.seconds for s in syncs),
    }
    if lora:
        start = time.perf_counter()
        with engine.eval_mode():
            probe_difference(engine, *probe_sequence(rollout))
        line["probe_s"] = time.perf_counter() - start
        line.update(serve_ways(args, engine, rollout, SamplingParams))
    return line


def serve_ways(args, engine, merged, sampling_params) -> dict:
    """Generation time: adapter merged (fused decode) vs PEFT layers in the forward vs base unfused."""
    from peft import inject_adapter_in_model
    from safetensors.torch import load_file

    from engines.rollout.hf import HFRolloutEngine
    from engines.training.fsdp.lora import peft_config
    from schema.engine import LoraConfig

    params = sampling_params(max_new_tokens=args.new_tokens, temperature=1.0, seed=0)
    prompts = [list(range(10, 10 + args.prompt)) for _ in range(args.gen_rows)]
    in_forward = HFRolloutEngine(args.model_dir, device="cpu", dtype="float32")
    with tempfile.TemporaryDirectory() as folder:
        engine.export_hf(folder)
        inject_adapter_in_model(
            peft_config(LoraConfig(rank=args.rank, alpha=2.0 * args.rank)), in_forward.model
        )
        state = {k.replace("base_model.model.", "").replace(".weight", ".default.weight"): v
                 for k, v in load_file(f"{folder}/adapter_model.safetensors").items()}  # fmt: skip
        missing = in_forward.model.load_state_dict(state, strict=False)
        assert not missing.unexpected_keys, missing.unexpected_keys
    in_forward._fused = None  # the fused step would bypass PEFT's layers
    base_unfused = HFRolloutEngine(args.model_dir, device="cpu", dtype="float32")
    base_unfused._fused = None
    engines = {"merged_fused": merged, "peft_forward": in_forward, "base_unfused": base_unfused}
    times: dict[str, list[float]] = {name: [] for name in engines}
    for rollout in engines.values():
        rollout.generate(prompts[:1], params)  # warm-up
    for _ in range(args.iters):  # interleaved: a neighbour's load falls on all three alike
        for name, rollout in engines.items():
            times[name].append(median_seconds(lambda r=rollout: r.generate(prompts, params), 1))
    return {f"generate_s_{name}": statistics.median(t) for name, t in times.items()}


def layer_cost(iters: int, tokens: int = 2048) -> dict:
    """PEFT's LoRA layer against a minimal own one (`base(x) + s * B(A(x))`), forward + backward of
    six qwen2-20m-shaped blocks of three adapted layers, alternating which goes first each repeat
    (the first of a pair ran ~10% slower in either order)."""
    import torch.nn.functional as F
    from peft import LoraConfig, inject_adapter_in_model
    from torch import nn

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.q_proj, self.gate_proj = nn.Linear(512, 512), nn.Linear(512, 1536, bias=False)
            self.down_proj = nn.Linear(1536, 512, bias=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.down_proj(F.silu(self.gate_proj(self.q_proj(x))))

    class OwnLora(nn.Module):
        def __init__(self, base: nn.Linear, rank: int = 16, alpha: float = 32) -> None:
            super().__init__()
            self.base, self.scaling = base, alpha / rank
            self.A = nn.Parameter(torch.randn(rank, base.in_features) * 0.01)
            self.B = nn.Parameter(torch.zeros(base.out_features, rank))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.base(x) + self.scaling * F.linear(F.linear(x, self.A), self.B)

    targets = ("q_proj", "gate_proj", "down_proj")
    models = {}
    for kind in ("peft", "own"):
        torch.manual_seed(0)
        model = nn.Sequential(*[Block() for _ in range(6)]).requires_grad_(False)
        if kind == "peft":
            inject_adapter_in_model(LoraConfig(r=16, lora_alpha=32, target_modules=list(targets)), model)
            for name, param in model.named_parameters():
                param.requires_grad_("lora_" in name)
        else:
            for block in model:
                for name in targets:
                    setattr(block, name, OwnLora(getattr(block, name)))
        models[kind] = model
    x = torch.randn(tokens, 512)
    times: dict[str, list[float]] = {kind: [] for kind in models}
    for i in range(iters + 2):
        for kind in ("peft", "own") if i % 2 else ("own", "peft"):
            start = time.perf_counter()
            models[kind](x).square().mean().backward()
            if i >= 2:
                times[kind].append(time.perf_counter() - start)
    peft_s, own_s = statistics.median(times["peft"]), statistics.median(times["own"])
    return {"layer_fwd_bwd_s_peft": peft_s, "layer_fwd_bwd_s_own": own_s, "peft_over_own": peft_s / own_s}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen2-20m", help="a built-in model name")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--response", type=int, default=128)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--gen-rows", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--quick", action="store_true", help="fewer rows and repeats")
    parser.add_argument("--mode", choices=["full", "lora"], help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=29611, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.quick:
        args.rows, args.response, args.iters, args.new_tokens = 8, 64, 3, 16
    if args.mode is not None:
        print(json.dumps(child(args)), flush=True)
        return
    from controller.models import builtin_model_path

    model_dir = str(builtin_model_path(args.model))
    lines = {}
    for port, mode in enumerate(("full", "lora"), start=args.port):
        print(f"== {mode}", file=sys.stderr, flush=True)
        argv = [a for a in sys.argv[1:] if a != "--quick"] + (["--quick"] if args.quick else [])
        cmd = [sys.executable, __file__, *argv, "--mode", mode, "--model-dir", model_dir, "--port", str(port)]
        result = subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=3600)
        lines[mode] = json.loads(result.stdout.strip().splitlines()[-1])
        print(json.dumps(lines[mode]), flush=True)
    full, lora = lines["full"], lines["lora"]
    ratios = {f"{key}_lora_over_full": lora[key] / full[key]
              for key in ("state_bytes", "peak_rss_mib", "update_s", "sync_bytes", "sync_s")}  # fmt: skip
    for other in ("peft_forward", "base_unfused"):
        ratios[f"generate_{other}_over_merged_fused"] = (
            lora[f"generate_s_{other}"] / lora["generate_s_merged_fused"]
        )
    print(json.dumps({"ratios": ratios, "load_average": os.getloadavg(), "quick": args.quick}), flush=True)
    torch.set_num_threads(args.threads)
    print(json.dumps({"lora_layer": layer_cost(2 * args.iters), "load_average": os.getloadavg()}), flush=True)


if __name__ == "__main__":
    main()
