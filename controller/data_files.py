"""Reading rows from local data files: JSON lines (`.jsonl`, or `.json` not starting with "["), a JSON
array of objects, or Parquet. Every row keeps its location ("line 3", "row 2") for error messages.

Files are UTF-8 (a byte-order mark is allowed); lines end at "\\n" only, since a JSON string may hold
U+2028 or NEL raw. A file holds at most MAX_ROWS rows: a row costs kilobytes once tokenized, and the
controller holds them all; a Parquet file at most MAX_PARQUET_BYTES uncompressed.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

JSON_SUFFIXES = (".jsonl", ".jsonlines", ".json")
PARQUET_SUFFIXES = (".parquet", ".pq")
MAX_ROWS = 2_000_000
MAX_PARQUET_BYTES = 2 * 1024**3


class DataError(ValueError):
    """A data file that cannot be used, with the file and the row that is wrong."""


def read_records(path: str | Path) -> list[tuple[str, dict[str, Any]]]:
    path = Path(path)
    if not path.is_file():
        raise DataError(f"data file {str(path)!r} does not exist")
    suffix = path.suffix.lower()
    if suffix in PARQUET_SUFFIXES:
        records = _read_parquet(path)
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


def _read_parquet(path: Path) -> list[tuple[str, Any]]:
    import pyarrow.parquet as pq

    try:
        meta = pq.ParquetFile(path).metadata
        _check_count(path, meta.num_rows)
        size = sum(meta.row_group(i).total_byte_size for i in range(meta.num_row_groups))
        if size > MAX_PARQUET_BYTES:  # a few compressed megabytes can hold gigabytes of one value
            raise DataError(f"{path}: {size:,} bytes uncompressed; a job reads at most {MAX_PARQUET_BYTES:,}")
        table = pq.read_table(path)
    except DataError:
        raise
    except Exception as exc:  # pyarrow raises several types for a corrupt or foreign file
        raise DataError(f"data file {str(path)!r} is not a readable Parquet file: {exc}") from exc
    return [(f"row {i}", row) for i, row in enumerate(table.to_pylist())]


def _read_json(path: Path) -> list[tuple[str, Any]]:
    with path.open("rb") as f:
        start = next((line.lstrip(b"\xef\xbb\xbf \t\r\n") for line in f if line.strip()), b"")
    if path.suffix.lower() == ".json" and start.startswith(b"["):
        rows = _parse(path, "", path.read_bytes())
        _check_count(path, len(rows))
        return [(f"row {i}", row) for i, row in enumerate(rows)]
    records = []
    with path.open("rb") as f:
        for number, line in enumerate(f, start=1):
            if number == 1 and line.startswith(b"\xef\xbb\xbf"):
                line = line[3:]
            if line.strip():
                _check_count(path, len(records) + 1)
                records.append((f"line {number}", _parse(path, f" line {number}", line)))
    return records


def _parse(path: Path, where: str, data: bytes) -> Any:
    """One JSON value of UTF-8 `data`; a DataError naming the file and `where` for anything else."""
    try:
        return json.loads(data.decode("utf-8-sig"))
    except UnicodeDecodeError as exc:
        raise DataError(f"{path}{where}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    except json.JSONDecodeError as exc:
        raise DataError(f"{path}{where}: invalid JSON: {exc}") from None
    except RecursionError:
        raise DataError(f"{path}{where}: invalid JSON: nested too deeply") from None


def _check_count(path: Path, rows: int) -> None:
    if rows > MAX_ROWS:
        raise DataError(
            f"{path}: more than {MAX_ROWS:,} rows; a job reads at most that many (sample or split the file)"
        )
