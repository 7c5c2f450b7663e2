"""Tool-using traces for a supervised warm start on the calculator task (`builtin:calculator`).

The RL task "calculator" is 3-digit products ("347*218=") answered through the calculator
environment (workers/environments/calculator.py). Its traces task, "calculator-traces", holds the
same problems (and the same train/val split) as SFT rows of the two assistant turns of a perfect
trajectory: first the tool call, then, after the tool's answer, the answer itself. Each response
ends with the chat template's turn-end token, so the warmed-up model stops its turns the way the
multi-turn rollout expects.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from controller.tasks.arithmetic import ArithmeticTask
from controller.tasks.splits import write_splits

TURN_END = "<|im_end|>"  # the built-in chat template's (engines/tiny_models.py)


@dataclass(frozen=True)
class CalculatorTracesTask:
    problems: ArithmeticTask = field(
        default_factory=lambda: ArithmeticTask(digits=3, operations=("*",), name="calculator")
    )
    default_train_size: int = 2000
    default_val_size: int = 64
    name: str = "calculator-traces"
    reward_function: str = "builtin:arithmetic"

    def make_split(self, split: str, size: int, seed: int = 0) -> list[dict[str, Any]]:
        """`size` problems of the split, two SFT rows each (the call, then the answer)."""
        rows = []
        for problem in self.problems.make_split(split, size, seed):
            question, answer = problem["prompt"], problem["ground_truth"]
            call = f"<calc>{question.rstrip('=')}</calc>"
            rows.append({"prompt": question, "response": call + TURN_END, "ground_truth": answer})
            conversation = [
                {"role": "user", "content": question},
                {"role": "assistant", "content": call},
                {"role": "tool", "content": answer},
            ]
            rows.append({"prompt": conversation, "response": answer + TURN_END, "ground_truth": answer})
        return rows

    def write_jsonl(
        self, directory: str | Path, train_size: int | None = None, val_size: int | None = None, seed: int = 0
    ) -> tuple[Path, Path]:
        return write_splits(self, directory, train_size, val_size, seed)
