"""`builtin:reasoning_gym`: a completion scored by its reasoning-gym task's own `score_answer`.

Every row that data.reasoning_gym generates carries, in its `extra`, the task's name and config and
the entry reasoning-gym generated (question, answer, metadata), so the reward needs nothing else:

    extra = {"reasoning_gym": {"task": "gcd", "config": {...}, "answer_format": "answer_tag",
                               "entry": {...}}}

The answer is read out of the completion first (`extract_answer`): with "answer_tag", the text
inside the last complete <answer>...</answer> pair, stripped (what reasoning-gym's own prompts ask for); with
"last_line", the last non-empty line, stripped. No answer scores 0.0. The score is the task's
`score_answer(answer, entry)`, which for most tasks is 1.0 for the exact answer and partial credit
for an answer that contains it; the "format" metric is 1.0 when an answer was found.

Several tasks' scorers evaluate the answer as Python (`eval`, sympy's `parse_expr`), so the
completion is untrusted input to them: controller/rewards.py runs this reward in the reward sandbox
(controller/reward_sandbox.py), as it does a user's function, never in the controller.

Entries cross a JSONL file, so `encode_entry` keeps what JSON would lose and some scorers compare:
tuples, sets and dicts with keys that are not strings, as tagged objects that `decode_entry`
turns back into plain containers (nothing else is ever constructed from a row).
"""

from __future__ import annotations

import json
import re
from functools import lru_cache
from typing import Any

TUPLE, SET, ITEMS = "__tuple__", "__set__", "__items__"
ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)  # the shortest span: pairs, not nests


# ---- entries through JSON -----------------------------------------------------------------------


def encode_entry(value: Any) -> Any:
    """`value` as plain JSON data, tuples, sets and non-string keys tagged."""
    if isinstance(value, tuple):
        return {TUPLE: [encode_entry(v) for v in value]}
    if isinstance(value, set | frozenset):
        return {SET: [encode_entry(v) for v in sorted(value, key=repr)]}
    if isinstance(value, dict):
        if all(isinstance(k, str) for k in value):
            return {k: encode_entry(v) for k, v in value.items()}
        return {ITEMS: [[encode_entry(k), encode_entry(v)] for k, v in value.items()]}
    if isinstance(value, list):
        return [encode_entry(v) for v in value]
    return value


def decode_entry(value: Any) -> Any:
    """The inverse of `encode_entry`."""
    if isinstance(value, list):
        return [decode_entry(v) for v in value]
    if not isinstance(value, dict):
        return value
    if len(value) == 1 and TUPLE in value:
        return tuple(decode_entry(v) for v in value[TUPLE])
    if len(value) == 1 and SET in value:
        return {_hashable(decode_entry(v)) for v in value[SET]}
    if len(value) == 1 and ITEMS in value:
        return {_hashable(decode_entry(k)): decode_entry(v) for k, v in value[ITEMS]}
    return {k: decode_entry(v) for k, v in value.items()}


def _hashable(value: Any) -> Any:
    if isinstance(value, list | dict | set):
        raise ValueError(f"a {type(value).__name__} cannot be a set member or a key")
    return value


# ---- the answer -------------------------------------------------------------------------------


def extract_answer(completion: str, answer_format: str) -> str | None:
    """The answer the completion gives, or None when it gives none (see the module docstring)."""
    if answer_format == "answer_tag":
        tagged = ANSWER_TAG.findall(completion)
        return tagged[-1].strip() if tagged else None
    if answer_format == "last_line":
        lines = [line.strip() for line in completion.splitlines() if line.strip()]
        return lines[-1] if lines else None
    raise ValueError(f"unknown answer_format '{answer_format}'; choose 'answer_tag' or 'last_line'")


# ---- scoring ----------------------------------------------------------------------------------


@lru_cache(maxsize=64)
def _scorer(task: str, config_json: str) -> Any:
    """The task's dataset object with the job's config: some scorers read their config."""
    import reasoning_gym

    return reasoning_gym.create_dataset(task, **json.loads(config_json), size=1, seed=0)


def reasoning_gym_reward(prompt: str, response: str, ground_truth: Any, extra: dict | None) -> dict:
    """{"score": the task's score of the extracted answer, "format": 1.0 when there was one}."""
    row = (extra or {}).get("reasoning_gym")
    if not isinstance(row, dict) or not {"task", "entry"} <= row.keys():
        raise ValueError(
            "builtin:reasoning_gym scores rows that data.reasoning_gym generated: this row's extra has "
            "no 'reasoning_gym' object with its task and entry"
        )
    answer = extract_answer(response, row.get("answer_format", "answer_tag"))
    if answer is None:
        return {"score": 0.0, "format": 0.0}
    config = json.dumps(row.get("config") or {}, sort_keys=True)
    score = _scorer(str(row["task"]), config).score_answer(answer, decode_entry(row["entry"]))
    return {"score": float(score), "format": 1.0}
