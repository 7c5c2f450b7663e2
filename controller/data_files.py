"""Reading rows from local data files: JSON lines (`.jsonl`, or `.json` not starting with "["), a JSON
array of objects, or Parquet. Every row keeps its location ("line 3", "row 2") for error messages.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

JSON_SUFFIXES = (".jsonl", ".jsonlines", ".json")
PARQUET_SUFFIXES = (".parquet", ".pq")


class DataError(ValueError):
    """A data file that cannot be used, with the file and the row that is wrong."""


def read_records(path: str | Path) -> list[tuple[str, dict[str, Any]]]:
    path = Path(path)
    if not path.is_file():
        raise DataError(f"data file {str(path)!r} does not exist")
    suffix = path.suffix.lower()
    if suffix in PARQUET_SUFFIXES:
        import pyarrow.parquet as pq

        try:
            table = pq.read_table(path)
        except Exception as exc:  # pyarrow raises several types for a corrupt or foreign file
            raise DataError(f"data file {str(path)!r} is not a readable Parquet file: {exc}") from exc
        records = [(f"row {i}", row) for i, row in enumerate(table.to_pylist())]
    elif suffix in JSON_SUFFIXES:
        records = _read_json(path)
    else:
        raise DataError(
            f"data file {str(path)!r} has an unknown extension {suffix!r}: "
            f"use one of {', '.join(JSON_SUFFIXES + PARQUET_SUFFIXES)}"
        )
    for where, row in records:
        if not isinstance(row, dict):
            raise DataError(f"{path} {where}: expected a JSON object, got {type(row).__name__}")
    return records


def _read_json(path: Path) -> list[tuple[str, Any]]:
    text = path.read_text()
    if path.suffix.lower() == ".json" and text.lstrip().startswith("["):
        try:
            return [(f"row {i}", row) for i, row in enumerate(json.loads(text))]
        except json.JSONDecodeError as exc:
            raise DataError(f"{path}: invalid JSON: {exc}") from exc
    records = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            records.append((f"line {number}", json.loads(line)))
        except json.JSONDecodeError as exc:
            raise DataError(f"{path} line {number}: invalid JSON: {exc}") from exc
    return records
