"""The built-in word-problem task: short arithmetic stories for a real chat model, ending with an
instruction to answer "Answer: N". Chat models rarely follow it exactly, so `extract_final_number`
reads, in order of trust, the last `\\boxed{...}`, the last "answer: N" / "answer is N", then the
last number. Splits are disjoint by a hash of the prompt, as in the arithmetic task.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from controller.tasks.arithmetic import apply, distinct_rows, extract_answer_text, split_rng

NAMES = ("Mia", "Tom", "Ava", "Leo", "Zoe", "Sam", "Ivy", "Max", "Eli", "Ana", "Ben", "Kim")
THINGS = ("apples", "shells", "stickers", "marbles", "books", "coins", "pencils", "cards", "stamps", "eggs")
INSTRUCTION = "End your reply with 'Answer: N', where N is the number."

# (template, operation): a and b fill the story, the answer is a OP b.
STORIES = (
    ("{name} has {a} {things} and finds {b} more. How many {things} does {name} have now?", "+"),
    ("A box holds {a} {things}. {name} puts in {b} more. How many {things} are in the box?", "+"),
    ("{name} had {a} {things} and gave away {b}. How many {things} does {name} have left?", "-"),
    ("There are {a} {things} on a shelf. {name} takes {b} of them. How many are left on the shelf?", "-"),
    ("{name} has {b} bags with {a} {things} in each bag. How many {things} does {name} have?", "*"),
)

_BOXED = re.compile(r"\\boxed\{\s*([^{}]*?)\s*\}")
_NUM = r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?|-?\d+(?:\.\d+)?"  # 1,200 | 37 | 37.5
_NUMBER = re.compile(_NUM)
_ANSWER_IS = re.compile(rf"answer\s*(?:is|:|=)?\s*[:=]?\s*\$?\s*({_NUM})", re.IGNORECASE)


@dataclass(frozen=True)
class WordProblemTask:
    """Stories over numbers from `low` to `high` (addition, subtraction) and factors from 2 to
    `factor_high` times 2 to 9 (multiplication); by default two-digit numbers."""

    low: int = 10
    high: int = 99
    factor_high: int = 12
    val_fraction: float = 0.1
    default_train_size: int = 2000
    default_val_size: int = 128
    name: str = "word-problems"

    def problem(self, story: int, a: int, b: int, name: str, things: str) -> dict[str, str]:
        template, op = STORIES[story]
        a, b, value = apply(op, a, b)
        text = template.format(name=name, things=things, a=a, b=b)
        return {"prompt": f"{text} {INSTRUCTION}", "ground_truth": str(value), "response": f"Answer: {value}"}

    def make_split(self, split: str, size: int, seed: int = 0) -> list[dict[str, str]]:
        """`size` distinct problems of `split`, in an order fixed by `seed`."""
        rng = split_rng(self.name, split, seed)

        def draw() -> dict[str, str]:
            story = rng.randrange(len(STORIES))
            multiply = STORIES[story][1] == "*"
            a = rng.randint(2, self.factor_high) if multiply else rng.randint(self.low, self.high)
            b = rng.randint(2, 9) if multiply else rng.randint(self.low, self.high)
            return self.problem(story, a, b, rng.choice(NAMES), rng.choice(THINGS))

        return distinct_rows(draw, split, size, self.val_fraction)


def extract_final_number(response: str) -> str | None:
    """The final answer of a free-text reply, normalised ("1,200" -> "1200", "37.0" -> "37"), or None."""
    text = extract_answer_text(response)
    for pattern in (_BOXED, _ANSWER_IS):
        found = [m.group(1) for m in pattern.finditer(text)]
        numbers = [n for f in found for n in _NUMBER.findall(f)]
        if numbers:
            return _normalise(numbers[-1])
    numbers = _NUMBER.findall(text)
    return _normalise(numbers[-1]) if numbers else None


def _normalise(number: str) -> str:
    number = number.replace(",", "")
    if "." in number:
        value = float(number)
        return str(int(value)) if value.is_integer() else str(value)
    return str(int(number))


def word_problem_reward(prompt: str, response: str, ground_truth: Any, extra: dict | None = None) -> dict:
    """The reward behind "builtin:word_problems": {"score": 0/1 (final number right), "format": 0/1
    ("Answer: N" present, as asked)}."""
    answer = extract_final_number(response)
    formatted = _ANSWER_IS.search(extract_answer_text(response)) is not None
    return {
        "score": float(answer is not None and answer == str(ground_truth).strip()),
        "format": float(formatted),
    }
