"""SmolLM2's forward + backward with this tree's attention and log-prob head against a commit's.

The update's model work on one GRPO micro-batch (`--groups` prompts of 36 tokens sharing their
prompt, 8 responses of 16 tokens each, entropy on), run by the same weights twice per round: once
with engines/attention.py, engines/shared_prompt.py and engines/logprobs.py as they are here, once
with those three files as they were at `--base` (read with `git show`, loaded as separate modules).
Rounds alternate which goes first; the figure is process CPU time at `--threads` (1 by default:
robust to other jobs on the machine). Prints one JSON line with both medians, their ratio, and the
largest differences of the log-probs and of the gradients between the two.

    python bench/layer_ab.py --base 67be28f [--groups 4] [--iters 8] [--threads 1]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def load_at(commit: str, folder: Path) -> dict:
    """The three modules at `commit`, importable side by side with this tree's (prefixed names)."""
    modules = {}
    for name in ("shared_prompt", "logprobs", "attention"):  # attention imports shared_prompt
        text = subprocess.run(
            ["git", "show", f"{commit}:engines/{name}.py"],
            cwd=ROOT,
            check=True,
            capture_output=True,
            text=True,
        ).stdout.replace("from engines.shared_prompt import", "from base_shared_prompt import")
        path = folder / f"base_{name}.py"
        path.write_text(text)
        spec = importlib.util.spec_from_file_location(f"base_{name}", path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[f"base_{name}"] = module
        spec.loader.exec_module(module)
        modules[name] = module
    return modules


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", required=True, help="the commit to compare against")
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--groups", type=int, default=4)
    parser.add_argument("--iters", type=int, default=8)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import AttentionInterface

    import engines.attention as attention
    import engines.fsdp.modules as fsdp_modules
    import engines.logprobs as logprobs
    import engines.shared_prompt as shared_prompt
    from controller.models import builtin_model_path

    base = load_at(args.base, Path(tempfile.mkdtemp()))
    here = {"attention": attention, "logprobs": logprobs, "shared_prompt": shared_prompt}
    name = attention.register()
    lm = fsdp_modules.load_hf_model(str(builtin_model_path(args.model)), name, False)
    model = fsdp_modules.PolicyModel(lm, 1024, 512 << 20).train()
    n, prompt_len, width = 8, 36, 16
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(10, lm.config.vocab_size, (args.groups, prompt_len), generator=g)
    responses = torch.randint(10, lm.config.vocab_size, (args.groups * n, width), generator=g)
    ids = torch.cat([prompts.repeat_interleave(n, 0), responses], 1)
    mask = torch.ones_like(ids)
    groups = shared_prompt.prompt_groups(ids, mask, width)
    sides = {"base": base, "here": here}
    packs = {k: m["shared_prompt"].pack_shared(ids, mask, width, groups) for k, m in sides.items()}

    def run(side: str) -> tuple[torch.Tensor, torch.Tensor]:
        AttentionInterface.register(name, sides[side]["attention"].segment_attention)
        fsdp_modules.token_log_probs = sides[side]["logprobs"].token_log_probs
        pack = packs[side]
        out = model(
            pack.input_ids, pack.position_ids, None, pack.targets, with_entropy=True, shared_prompt=pack
        )
        (out["log_probs"].sum() + out["entropy"].sum()).backward()
        grads = torch.cat([p.grad.flatten() for p in model.parameters()])
        model.zero_grad(set_to_none=True)
        return out["log_probs"].detach(), grads

    (lp_base, grad_base), (lp_here, grad_here) = run("base"), run("here")
    times: dict[str, list[float]] = {k: [] for k in sides}
    for i in range(args.iters):
        for side in list(sides) if i % 2 else list(sides)[::-1]:
            start = time.process_time()
            run(side)
            times[side].append(time.process_time() - start)
    med = {k: statistics.median(v) for k, v in times.items()}
    print(json.dumps({
        "bench": "layer_ab", "base": args.base, "groups": args.groups, "threads": args.threads,
        "packed_tokens": packs["here"].num_tokens, "base_cpu_s": round(med["base"], 3),
        "here_cpu_s": round(med["here"], 3), "ratio_here_vs_base": round(med["here"] / med["base"], 4),
        "max_log_prob_diff": float((lp_here - lp_base).abs().max()),
        "max_grad_diff_rel": float((grad_here - grad_base).abs().max() / grad_base.abs().max()),
        "load_average": [round(x, 2) for x in os.getloadavg()],
    }))  # fmt: skip


if __name__ == "__main__":
    main()
