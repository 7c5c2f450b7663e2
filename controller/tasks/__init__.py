"""Built-in tasks: synthetic data sets with a rule reward, addressed by name in `DataSpec.builtin_task`.
A job's rows are written to JSONL (`write_splits`) and loaded like user data, so the built-in demo
exercises the real data loader.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Protocol

from controller.tasks.arithmetic import ArithmeticTask
from controller.tasks.calculator import CALCULATOR_TOOL, CalculatorTracesTask, endpoint_call
from controller.tasks.guess_number import GuessNumberTask, GuessNumberTracesTask
from controller.tasks.word_problems import WordProblemTask


class Task(Protocol):
    name: str
    default_train_size: int
    default_val_size: int

    def make_split(self, split: str, size: int, seed: int = 0) -> list[dict[str, Any]]: ...


BUILTIN_TASKS: dict[str, Task] = {
    "arithmetic": ArithmeticTask(),
    "arithmetic-3digit": ArithmeticTask(digits=3, name="arithmetic-3digit"),
    "arithmetic-mixed": ArithmeticTask(operations=("+", "-", "*"), name="arithmetic-mixed"),
    # Stories for a real chat model (e.g. model.builtin smollm2-135m-instruct), scored by the last number.
    "word-problems": WordProblemTask(),
    # Easy enough for a 135M model that GRPO groups hold right and wrong answers.
    "word-problems-easy": WordProblemTask(low=1, high=9, factor_high=5, name="word-problems-easy"),
    # For rollout.environment "builtin:calculator": 3-digit products, a tool call away.
    "calculator": ArithmeticTask(digits=3, operations=("*",), name="calculator"),
    "calculator-traces": CalculatorTracesTask(),  # SFT warm start for "calculator"
    # SFT warm start for an agent with the `calculator` tool on a job's OpenAI endpoint (agent_openai.py)
    "calculator-tool-traces": CalculatorTracesTask(
        name="calculator-tool-traces", call=endpoint_call, tools=(CALCULATOR_TOOL,)
    ),
    "guess_number": GuessNumberTask(),
    "guess_number-traces": GuessNumberTracesTask(),  # SFT warm start for "guess_number"
    # One range of 8 ("Guess 1-8."): a game a tiny chat model learns from random weights.
    "guess_number-1to8": GuessNumberTask(span=8, max_low=1, name="guess_number-1to8"),
    # Full reward only for a solve within 3 turns, so halving the interval beats guessing inside it.
    "guess_number-1to8-in3": GuessNumberTask(span=8, max_low=1, solve_within=3, name="guess_number-1to8-in3"),
    # SFT warm start for it: games that guess uniformly inside the interval the hints leave.
    "guess_number-1to8-traces": GuessNumberTracesTask(
        game=GuessNumberTask(span=8, max_low=1, name="guess_number-1to8"),
        turns=4,  # the GRPO stage's max_turns
        inside_hints=True,
        default_train_size=20_000,  # rows: an SFT run of 200 x 64 sees each at most once, none memorised
        name="guess_number-1to8-traces",
    ),
}


def get_task(name: str) -> Task:
    try:
        return BUILTIN_TASKS[name]
    except KeyError:
        raise ValueError(f"unknown built-in task '{name}'; choose one of {sorted(BUILTIN_TASKS)}") from None


def write_splits(
    task: Task | str,
    directory: str | Path,
    train_size: int | None = None,
    val_size: int | None = None,
    seed: int = 0,
) -> tuple[Path, Path]:
    """train.jsonl and val.jsonl of `task` (or the built-in task of that name) under `directory`
    (default sizes when None)."""
    task = get_task(task) if isinstance(task, str) else task
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    train, val = directory / "train.jsonl", directory / "val.jsonl"
    write_rows(
        train, task.make_split("train", task.default_train_size if train_size is None else train_size, seed)
    )
    write_rows(val, task.make_split("val", task.default_val_size if val_size is None else val_size, seed))
    return train, val


def write_rows(path: Path, rows: list[dict[str, Any]]) -> None:
    """JSONL written under a temporary name and renamed: no reader sees half a file."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    with tmp.open("w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    tmp.replace(path)
