"""What both sides of bench/vs_trl.py train on: the shapes, the prompts, the rewards, the LoRA setup,
and a step's time from its end times."""

from __future__ import annotations

from pathlib import Path

# shape name -> (built-in model, max new tokens)
SHAPES = {"small": ("qwen2-1m", 8), "large": ("qwen2-20m", 32)}
LORA = {"rank": 16, "alpha": 32.0}  # --lora: the same on both sides, all linear layers


def write_prompts(folder: Path, rows: int) -> Path:
    from controller.tasks import write_splits
    from controller.tasks.arithmetic import ArithmeticTask

    train, _ = write_splits(ArithmeticTask(), folder, train_size=rows, val_size=1, seed=0)
    return train


def digit_share(prompt: str, response: str, ground_truth: object, extra: dict | None = None) -> dict:
    """The `digits` reward: the share of the response's characters that are digits."""
    return {"score": sum(c.isdigit() for c in response) / max(len(response), 1)}


# The Tandem job imports its reward by path, the TRL side calls it (reward_function).
REWARDS = {"arithmetic": "builtin:arithmetic", "digits": f"{Path(__file__).resolve()}:digit_share"}


def reward_function(name: str):
    """The reward as a Python function (the TRL side)."""
    if name == "digits":
        return digit_share
    from controller.tasks.arithmetic import arithmetic_reward

    return arithmetic_reward


def step_intervals(ends: list[float], paused: list[float] | None = None) -> list[float]:
    """Seconds of each step after the first (the first includes warm-up), less the seconds spent
    measuring the machine after the step before it (`paused[i]`: after the step that ended at ends[i])."""
    paused = paused or [0.0] * len(ends)
    return [b - a - p for a, b, p in zip(ends[:-1], ends[1:], paused, strict=False)]
