"""`builtin:reasoning_gym`: a completion scored by its reasoning-gym task's own `score_answer`.

Each row that data.reasoning_gym generates carries its task, config and entry in
`extra["reasoning_gym"]`. The answer is the last complete <answer>...</answer> ("answer_tag") or the
last non-empty line ("last_line"); none scores 0.0. Some scorers `eval` the answer, so this reward runs
in the reward sandbox. `encode_entry` keeps through JSON what some scorers compare: tuples, sets and
dicts with non-string keys, tagged (`decode_entry` builds plain containers only).
"""

from __future__ import annotations

import json
import re
from functools import lru_cache
from typing import Any

TUPLE, SET, ITEMS = "__tuple__", "__set__", "__items__"
ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)  # the shortest span: pairs, not nests


def encode_entry(value: Any) -> Any:
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


def extract_answer(completion: str, answer_format: str) -> str | None:
    if answer_format == "answer_tag":
        tagged = ANSWER_TAG.findall(completion)
        return tagged[-1].strip() if tagged else None
    if answer_format == "last_line":
        lines = [line.strip() for line in completion.splitlines() if line.strip()]
        return lines[-1] if lines else None
    raise ValueError(f"unknown answer_format '{answer_format}'; choose 'answer_tag' or 'last_line'")


@lru_cache(maxsize=64)
def _scorer(task: str, config_json: str) -> Any:
    """The task's dataset object with the job's config (some scorers read it)."""
    import reasoning_gym

    return reasoning_gym.create_dataset(task, **json.loads(config_json), size=1, seed=0)


def reasoning_gym_reward(prompt: str, response: str, ground_truth: Any, extra: dict | None) -> dict:
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
