"""Learning curves of the built-in environments on a CPU: SFT warm start, then multi-turn GRPO.

calculator: qwen2-1m-chat is fine-tuned on tool-using traces ("calculator-traces": call the
calculator, then copy its answer), then GRPO with `builtin:calculator` on 3-digit products. Printed
per validation: greedy success rate, mean turns and tool calls per trajectory.

guess_number: GRPO with `builtin:guess_number` from the same kind of start (the SFT stage teaches
the format on random-guess games), printed the same way: reward and turns per game.

    .venv/bin/python bench/multiturn_learning.py --env calculator [--sft-steps 300 --grpo-steps 60]
    .venv/bin/python bench/multiturn_learning.py --env calculator --init SFT_EXPORT --lr 1e-3 --warmup 10

Prints JSON lines; bench/RESULTS.md keeps the measured curves, tests/test_multiturn_learning.py
asserts the calculator's (slow).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from controller.sink import JsonlSink
from controller.spec import JobSpec
from controller.trainer import Trainer

# budget: the trajectory's tokens after its first prompt. With the character-level chat model one
# guess_number turn costs ~31 tokens (a guess, <|im_end|>, and a rendered "higher"/"lower" user
# turn with the next assistant header), so 8 turns need ~250: at 160 every game was cut off by the
# budget after ~5 turns and max_turns 8 (and the 0.5 reward for a late solve) were out of reach.
SETUPS = {
    "calculator": {"sft_task": "calculator-traces", "task": "calculator", "max_turns": 3,
                   "max_new_tokens": 24, "budget": 96},
    "guess_number": {"sft_task": "guess_number-traces", "task": "guess_number", "max_turns": 8,
                     "max_new_tokens": 4, "budget": 256},
}  # fmt: skip


def sft_spec(setup: dict, steps: int) -> JobSpec:
    return JobSpec.model_validate(
        {
            "method": "sft",
            "model": {"builtin": "qwen2-1m-chat"},
            "data": {"builtin_task": setup["sft_task"], "max_prompt_length": 128},
            "rollout": {"max_new_tokens": setup["max_new_tokens"], "free_cache_after_generate": False},
            "optim": {"lr": 2e-3},
            "trainer": {"total_steps": steps, "prompts_per_step": 64, "val_every": 0},
            "checkpoint": {"every": 0},
        }
    )


def grpo_spec(
    setup: dict, model_path: str, steps: int, val_every: int, lr: float = 5e-4, warmup: int = 0
) -> JobSpec:
    return JobSpec.model_validate(
        {
            "method": "grpo",
            "model": {"path": model_path},
            "data": {"builtin_task": setup["task"], "max_prompt_length": 64},
            "rollout": {
                "environment": f"builtin:{setup['task']}",
                "max_turns": setup["max_turns"],
                "max_response_tokens": setup["budget"],
                "max_new_tokens": setup["max_new_tokens"],
                "n": 8,
                "free_cache_after_generate": False,
            },
            "optim": {"lr": lr, "warmup_steps": warmup},
            "trainer": {"total_steps": steps, "prompts_per_step": 16, "val_every": val_every, "val_size": 64},
            "checkpoint": {"every": 0, "export_hf": False},
        }
    )


def run(spec: JobSpec, workdir: Path, label: str) -> list[dict]:
    sink = JsonlSink(workdir)
    start = time.perf_counter()
    Trainer(spec, workdir, sink, name=label).run()
    print(json.dumps({"stage": label, "seconds": round(time.perf_counter() - start, 1)}), flush=True)
    return sink.history


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--env", choices=sorted(SETUPS), default="calculator")
    parser.add_argument("--sft-steps", type=int, default=300)
    parser.add_argument("--grpo-steps", type=int, default=60)
    parser.add_argument("--val-every", type=int, default=10)
    parser.add_argument("--lr", type=float, default=5e-4, help="GRPO learning rate")
    parser.add_argument("--warmup", type=int, default=0, help="GRPO learning-rate warmup steps")
    parser.add_argument("--init", default=None, help="start GRPO from this HF folder (an earlier SFT export)")
    parser.add_argument("--workdir", default="/tmp/tandem-multiturn-bench")
    args = parser.parse_args()
    os.environ.setdefault("TANDEM_HOME", str(Path(args.workdir) / "home"))
    setup, root = SETUPS[args.env], Path(args.workdir) / args.env
    import ray

    ray.init(namespace="tandem-bench", logging_level="warning")
    init = args.init
    if init is None:
        history = run(sft_spec(setup, args.sft_steps), root / "sft", f"{args.env}-sft")
        print(json.dumps({"stage": "sft", "final_loss": history[-1]["values"].get("sft/loss")}), flush=True)
        init = str(root / "sft" / "export")
    history = run(grpo_spec(setup, init, args.grpo_steps, args.val_every, args.lr, args.warmup),
                  root / "grpo", f"{args.env}-grpo")  # fmt: skip
    for record in history:
        v = record["values"]
        if "val/accuracy" in v:
            print(json.dumps({"env": args.env, "step": record["step"], "val_accuracy": v["val/accuracy"],
                              "val_reward": v["val/score/mean"],
                              "val_turns": v.get("val/multiturn/num_turns/mean"),
                              "val_tool_calls": v.get("val/multiturn/tool_calls/mean"),
                              "train_reward": v.get("critic/score/mean")}), flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
