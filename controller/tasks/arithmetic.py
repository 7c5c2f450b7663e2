"""The built-in arithmetic task: "23+58=" answered "81". With the defaults (two-digit addition) a
~1M-parameter model learns much of it from a short SFT run on a CPU, and the carries leave room for RL.
Train and val are disjoint by a stable hash of each problem's text (not Python's salted `hash`).
"""

from __future__ import annotations

import hashlib
import random
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

# Decoders may keep special tokens in the text; the answer ends at the first of them.
_END_MARKERS = ("<|endoftext|>", "<|im_end|>", "<|pad|>")
_ANSWER = re.compile(r"-?\d+")
_OPERATIONS = ("+", "-", "*")
# Problem spaces up to this size are enumerated exactly; larger ones are sampled by rejection.
_ENUMERATE_LIMIT = 200_000


@dataclass(frozen=True)
class ArithmeticTask:
    digits: int = 2
    operations: tuple[str, ...] = ("+",)
    val_fraction: float = 0.1
    default_train_size: int = 5000
    default_val_size: int = 500
    name: str = "arithmetic"

    def __post_init__(self) -> None:
        if self.digits < 1:
            raise ValueError(f"arithmetic digits must be >= 1, got {self.digits}")
        unknown = [op for op in self.operations if op not in _OPERATIONS]
        if unknown or not self.operations:
            raise ValueError(
                f"arithmetic operations must be a non-empty subset of {_OPERATIONS}, got {unknown}"
            )
        if not 0.0 < self.val_fraction < 1.0:
            raise ValueError(f"val_fraction must be in (0, 1), got {self.val_fraction}")

    @property
    def operand_range(self) -> tuple[int, int]:
        low = 0 if self.digits == 1 else 10 ** (self.digits - 1)
        return low, 10**self.digits - 1

    @property
    def space_size(self) -> int:
        low, high = self.operand_range
        return (high - low + 1) ** 2 * len(self.operations)

    def problem(self, a: int, op: str, b: int) -> dict[str, str]:
        a, b, answer = apply(op, a, b)
        return {"prompt": f"{a}{op}{b}=", "ground_truth": answer, "response": answer}

    def make_split(self, split: str, size: int, seed: int = 0) -> list[dict[str, str]]:
        """`size` distinct problems of `split`, in an order fixed by `seed` ("response": for SFT)."""
        rng = split_rng(self.name, split, seed)
        if size < 0:
            raise ValueError(f"split size must be >= 0, got {size}")
        if self.space_size <= _ENUMERATE_LIMIT:
            pool = [
                row for row in self._all_problems() if split_of(row["prompt"], self.val_fraction) == split
            ]
            if size > len(pool):
                raise ValueError(
                    f"the {split} split of {self.describe()} has only {len(pool)} distinct problems; "
                    f"asked for {size}: lower the size or raise the digits"
                )
            return rng.sample(pool, size)
        return self._sample_distinct(split, size, rng)

    def describe(self) -> str:
        return f"{self.digits}-digit arithmetic ({''.join(self.operations)})"

    def _all_problems(self) -> Iterator[dict[str, str]]:
        low, high = self.operand_range
        seen: set[str] = set()
        for op in self.operations:
            for a in range(low, high + 1):
                for b in range(low, high + 1):
                    row = self.problem(a, op, b)
                    if row["prompt"] not in seen:  # a-b and b-a collapse into one problem
                        seen.add(row["prompt"])
                        yield row

    def _sample_distinct(self, split: str, size: int, rng: random.Random) -> list[dict[str, str]]:
        if size > self.space_size // 4:
            raise ValueError(f"{size} {split} rows is too many for {self.describe()}: sample fewer")
        low, high = self.operand_range
        ops = self.operations
        pick = lambda: self.problem(rng.randint(low, high), rng.choice(ops), rng.randint(low, high))  # noqa: E731
        return distinct_rows(pick, split, size, self.val_fraction)


def apply(op: str, a: int, b: int) -> tuple[int, int, str]:
    """(a, b, the answer's text); a - b with a < b is asked as b - a: answers stay non-negative."""
    if op == "-" and a < b:
        a, b = b, a
    return a, b, str(a + b if op == "+" else a - b if op == "-" else a * b)


def distinct_rows(
    draw: Callable[[], dict[str, str]], split: str, size: int, val_fraction: float
) -> list[dict[str, str]]:
    """`size` rows of `split` with distinct prompts, drawn until there are enough."""
    rows: dict[str, dict[str, str]] = {}
    while len(rows) < size:
        row = draw()
        if row["prompt"] not in rows and split_of(row["prompt"], val_fraction) == split:
            rows[row["prompt"]] = row
    return list(rows.values())


def split_of(prompt: str, val_fraction: float) -> str:
    """'val' or 'train', fixed by the prompt's text alone."""
    digest = hashlib.blake2b(prompt.encode(), digest_size=8).digest()
    return "val" if int.from_bytes(digest, "big") / 2**64 < val_fraction else "train"


def split_rng(name: str, split: str, seed: int) -> random.Random:
    """The stream of task `name`'s `split`: seed and split both feed it, so orders are unrelated."""
    if split not in ("train", "val"):
        raise ValueError(f"split must be 'train' or 'val', got {split!r}")
    return random.Random(f"{name}:{split}:{seed}")


def arithmetic_reward(prompt: str, response: str, ground_truth: Any, extra: dict | None = None) -> dict:
    """ "builtin:arithmetic": the leading integer of the response (cut at the end-of-text token) vs the
    truth: {"score": 0 or 1, "format": 1 when nothing follows it}."""
    text = extract_answer_text(response)
    match = _ANSWER.match(text)
    answer = match.group() if match else ""
    correct = bool(answer) and answer == str(ground_truth).strip()
    well_formed = _ANSWER.fullmatch(text) is not None
    return {"score": float(correct), "format": float(well_formed)}


def arithmetic_partial_reward(
    prompt: str, response: str, ground_truth: Any, extra: dict | None = None
) -> dict:
    """ "builtin:arithmetic_partial", for models that cannot answer yet: 1.0 when right, else 0.1 for a
    leading integer, 0.1 more for nothing after it, up to 0.3 for digits in their places; "correct"
    keeps the exact score."""
    exact = arithmetic_reward(prompt, response, ground_truth)
    if exact["score"] == 1.0:
        return {**exact, "correct": 1.0}
    match = _ANSWER.match(extract_answer_text(response))
    if match is None:
        return {"score": 0.0, "format": 0.0, "correct": 0.0}
    answer, truth = match.group(), str(ground_truth).strip()
    in_place = sum(a == b for a, b in zip(answer[::-1], truth[::-1], strict=False)) / max(len(truth), 1)
    return {"score": 0.1 + 0.1 * exact["format"] + 0.3 * in_place, "format": exact["format"], "correct": 0.0}


def extract_answer_text(response: str) -> str:
    for marker in _END_MARKERS:
        response = response.split(marker, 1)[0]
    return response.strip()


make_split = ArithmeticTask().make_split  # the default task's splits
