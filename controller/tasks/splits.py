"""Writing a task's train and val splits as JSONL, the one way every built-in task does it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Protocol


class _Splits(Protocol):
    default_train_size: int
    default_val_size: int

    def make_split(self, split: str, size: int, seed: int = 0) -> list[dict[str, Any]]: ...


def write_splits(
    task: _Splits,
    directory: str | Path,
    train_size: int | None = None,
    val_size: int | None = None,
    seed: int = 0,
) -> tuple[Path, Path]:
    """train.jsonl and val.jsonl of `task` under `directory` (default sizes when None)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    train, val = directory / "train.jsonl", directory / "val.jsonl"
    write_rows(
        train, task.make_split("train", task.default_train_size if train_size is None else train_size, seed)
    )
    write_rows(val, task.make_split("val", task.default_val_size if val_size is None else val_size, seed))
    return train, val


def write_rows(path: Path, rows: list[dict[str, Any]]) -> None:
    """`rows` as JSONL at `path`, written under a temporary name and renamed: no reader sees half a file."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    with tmp.open("w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    tmp.replace(path)
