"""reasoning-gym tasks (data.reasoning_gym): their rows, written as train.jsonl and val.jsonl, and
`builtin:reasoning_gym`, which scores a completion by its task's own `score_answer`.

Each row picks its task by a seeded weighted draw and takes that task's next item from a dataset seeded
by (seed, split, task), so a spec gives the same rows on every run; validation leaves out any question
among the training rows'. Generating runs in a process of its own bounded by `timeout_s`, and the files are
kept beside the spec that made them. A row carries its task, config and entry in `extra["reasoning_gym"]`
(`encode_entry` keeps through JSON the tuples, sets and non-string-keyed dicts some scorers compare).
The answer is the last complete <answer>...</answer> ("answer_tag") or the last non-empty line
("last_line"); none scores 0.0. Some scorers `eval` the answer: this reward runs in the reward sandbox.
"""

from __future__ import annotations

import hashlib
import json
import random
import re
from functools import lru_cache
from pathlib import Path
from typing import Any

from controller.data_files import DataError
from controller.tasks import write_rows
from schema.reasoning_gym import ReasoningGymSpec

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


VAL_DRAWS_PER_ROW = 16  # validation draws per row asked, at most, while too many repeat a training one


def make_rows(
    spec: ReasoningGymSpec, split: str, size: int, skip: frozenset[str] = frozenset()
) -> list[dict]:
    import reasoning_gym
    from reasoning_gym.utils import SYSTEM_PROMPTS

    picks = random.Random(f"{spec.seed}/{split}").choices(
        range(len(spec.tasks)), [task.weight for task in spec.tasks], k=size
    )
    datasets = [
        reasoning_gym.create_dataset(task.name, **task.config, seed=_task_seed(spec, split, k),
                                     size=max(picks.count(k), 1))
        for k, task in enumerate(spec.tasks)
    ]  # fmt: skip
    taken = [0] * len(spec.tasks)
    instructions = SYSTEM_PROMPTS[spec.instructions].strip() + "\n\n" if spec.instructions else ""
    rows = []
    for k in picks:
        task, entry = spec.tasks[k], datasets[k][taken[k]]
        taken[k] += 1
        if entry["question"] in skip:
            continue
        answer = None if entry["answer"] is None else str(entry["answer"])
        rows.append({
            "prompt": instructions + entry["question"],
            "ground_truth": answer,
            "response": None if answer is None else _formatted(answer, spec.answer_format),
            "extra": {"reasoning_gym": {"task": task.name, "config": task.config,
                                        "answer_format": spec.answer_format, "entry": encode_entry(entry)}},
        })  # fmt: skip
    return rows


def held_out_rows(spec: ReasoningGymSpec, seen: frozenset[str]) -> list[dict]:
    """Up to val_size rows whose questions are not among the training rows': draws double while too
    many repeat one (a small task's questions do), up to VAL_DRAWS_PER_ROW per row asked; none at all
    is a DataError, since validation was asked for."""
    if not spec.val_size:
        return []
    draws = spec.val_size
    while True:
        rows = make_rows(spec, "val", draws, skip=seen)
        if len(rows) >= spec.val_size or draws >= VAL_DRAWS_PER_ROW * spec.val_size:
            break
        draws *= 2
    if not rows:
        raise DataError(
            f"data.reasoning_gym.size: every validation question drawn is among the {spec.size} training "
            f"rows' (the tasks have fewer distinct questions); lower data.reasoning_gym.size or set val_size 0"
        )
    return rows[: spec.val_size]


def _task_seed(spec: ReasoningGymSpec, split: str, k: int) -> int:
    # Datasets seed item i with seed + i: far-apart seeds keep the splits' items apart.
    digest = hashlib.sha256(f"{spec.seed}/{split}/{k}/{spec.tasks[k].name}".encode()).digest()
    return int.from_bytes(digest[:4], "big")


def _formatted(answer: str, answer_format: str) -> str:
    return f"<answer>{answer}</answer>" if answer_format == "answer_tag" else answer


def write_reasoning_gym_files(spec: ReasoningGymSpec, directory: str | Path) -> tuple[Path, Path | None]:
    """train.jsonl (and val.jsonl unless val_size is 0) under `directory`, kept from an earlier call
    with the same spec; DataError says what failed."""
    directory = Path(directory)
    made_by, train, val = directory / "spec.json", directory / "train.jsonl", directory / "val.jsonl"
    wanted = spec.model_dump_json()
    if not (made_by.is_file() and made_by.read_text() == wanted and train.is_file()):
        directory.mkdir(parents=True, exist_ok=True)
        made_by.unlink(missing_ok=True)
        _generate_in_child(spec, directory)
        made_by.write_text(wanted)
    return train, val if val.is_file() else None


def _generate_in_child(spec: ReasoningGymSpec, directory: Path) -> None:
    """`_generate` in a process of its own, ended at `timeout_s`; its failures as DataErrors."""
    from workers.sandbox.channel import Sandbox, SandboxCrashed, SandboxError, SandboxTimeout
    from workers.sandbox.limits import Limits

    names = ", ".join(task.name for task in spec.tasks)
    # reasoning-gym is the service's code: a plain process, no limits but the time
    with Sandbox(limits=Limits(None, None), stderr=None, mode="none") as box:
        try:
            box.call(
                f"{__name__}:_generate", [spec.model_dump_json(), str(directory.resolve())], spec.timeout_s
            )
        except SandboxTimeout:
            raise DataError(
                f"data.reasoning_gym: generating {spec.size} + {spec.val_size} rows of {names} did not "
                f"finish within {spec.timeout_s:g} s; lower data.reasoning_gym.size or raise timeout_s"
            ) from None
        except SandboxCrashed as err:
            raise DataError(
                f"data.reasoning_gym: the process generating rows of {names} ended before it finished "
                f"({err.message})"
            ) from None
        except SandboxError as err:  # a DataError of ours already says which setting to change
            ours = err.type == "DataError"
            why = f"data.reasoning_gym: generating rows of {names} failed: {err.type}: {err.message}"
            raise DataError(err.message if ours else why) from None


def _generate(spec_json: str, directory: str) -> dict[str, int]:
    """The child's side: write the split files; the rows' counts."""
    spec = ReasoningGymSpec.model_validate_json(spec_json)
    train = make_rows(spec, "train", spec.size)
    write_rows(Path(directory) / "train.jsonl", train)
    val_file = Path(directory) / "val.jsonl"
    val_file.unlink(missing_ok=True)
    seen = frozenset(row["extra"]["reasoning_gym"]["entry"]["question"] for row in train)
    val = held_out_rows(spec, seen)
    if val:
        write_rows(val_file, val)
    return {"train": len(train), "val": len(val)}
