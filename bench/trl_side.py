"""The TRL side of bench/vs_trl.py: TRL's GRPOTrainer with the defaults a user gets, on the same
model, prompts and settings as the Tandem side; returns the seconds of each step after the first."""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from bench.vs_trl_task import LORA, reward_function, step_intervals


def trl_dataset(train: str, tokenizer):
    from datasets import Dataset

    rows = [json.loads(line) for line in Path(train).read_text().splitlines()]
    # Tandem renders a prompt through the tokenizer's chat template when it has one
    # (controller/data.py); TRL does the same for a conversational prompt, so both see the same tokens.
    chat = bool(getattr(tokenizer, "chat_template", None))
    return Dataset.from_list(
        [
            {"prompt": [{"role": "user", "content": r["prompt"]}] if chat else r["prompt"],
             "ground_truth": r["ground_truth"]}
            for r in rows
        ]
    )  # fmt: skip


def trl_reward(name: str):
    score_fn = reward_function(name)

    def text(item: str | list[dict]) -> str:
        return item if isinstance(item, str) else item[-1]["content"]

    def reward(prompts: list, completions: list, ground_truth: list[str], **_: object) -> list[float]:
        return [
            float(score_fn(text(p), text(c), g)["score"])
            for p, c, g in zip(prompts, completions, ground_truth, strict=True)
        ]

    return reward


def trl_config(args: argparse.Namespace):
    from trl import GRPOConfig

    return GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="vs-trl-"),
        per_device_train_batch_size=args.prompts * args.n,
        gradient_accumulation_steps=1,
        num_generations=args.n,
        max_completion_length=args.max_new_tokens,
        learning_rate=args.lr,
        beta=0.0,
        temperature=1.0,
        max_steps=args.steps,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=args.device == "cpu",
        bf16=args.device == "cuda",  # fp32 weights, bf16 autocast: as Tandem computes on CUDA
        seed=0,
        shuffle_dataset=False,
        disable_tqdm=True,
    )


def run_trl(args: argparse.Namespace) -> list[float]:
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOTrainer

    ends: list[float] = []

    class StepClock(TrainerCallback):
        def on_step_end(self, *_: object, **__: object) -> None:
            ends.append(time.perf_counter())

    tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    peft_config = None
    if args.lora:
        from peft import LoraConfig

        peft_config = LoraConfig(
            r=LORA["rank"], lora_alpha=LORA["alpha"], target_modules="all-linear", task_type="CAUSAL_LM"
        )
    trainer = GRPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(args.model_dir, dtype="float32"),
        reward_funcs=trl_reward(args.reward),
        args=trl_config(args),
        train_dataset=trl_dataset(args.train, tokenizer),
        processing_class=tokenizer,
        callbacks=[StepClock()],
        peft_config=peft_config,
    )
    trainer.train()
    return step_intervals(ends)
