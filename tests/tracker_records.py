"""Reading what the trackers wrote, each with its own library's reader (for tests/test_trackers.py).

TensorBoard: its EventAccumulator. MLflow: MlflowClient. W&B offline runs: the run's `.wandb` file,
parsed into wandb's own `Record` protobufs (wandb 0.31 ships no Python reader for the file; its
framing is LevelDB's log format after a 7-byte ':W&B' header), and the run folder's table files.
"""

from __future__ import annotations

import json
import struct
import time
from pathlib import Path
from typing import Any

BLOCK = 32 * 1024  # LevelDB log blocks
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def tensorboard_scalars(logdir: Path, tag: str) -> list[tuple[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(logdir), size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    return [(e.step, e.value) for e in events.Scalars(tag)]


def tensorboard_texts(logdir: Path, tag: str) -> list[tuple[int, str]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(logdir), size_guidance={"tensors": 0})
    events.Reload()
    return [(e.step, e.tensor_proto.string_val[0].decode()) for e in events.Tensors(f"{tag}/text_summary")]


def wandb_records(run_file: Path) -> list[Any]:
    from wandb.proto import wandb_internal_pb2

    data = run_file.read_bytes()
    assert data[:4] == b":W&B", run_file
    records, partial, pos = [], b"", 7
    while pos + 7 <= len(data):
        if BLOCK - pos % BLOCK < 7:  # a block's tail too short for a header is padding
            pos += BLOCK - pos % BLOCK
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind == FULL:
            records.append(chunk)
        elif kind == FIRST:
            partial = chunk
        elif kind == MIDDLE:
            partial += chunk
        elif kind == LAST:
            records.append(partial + chunk)
        elif kind == 0 and length == 0:  # zero padding to the block's end
            pos += BLOCK - pos % BLOCK
    return [wandb_internal_pb2.Record.FromString(r) for r in records]


def wandb_run_files(workdir: Path, timeout_s: float = 30.0) -> list[Path]:
    """The job folder's offline run files, once each holds its run's last record (`exit`).

    `run.finish()` returns before wandb's own service process has written everything to the file
    (seen under load: a fork's file read right after its finish lacked the run's config), so a
    reader waits for the record that ends a run, and fails naming the files that never got it.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        files = sorted(workdir.glob("wandb/offline-run-*/run-*.wandb"))
        unfinished = {f: why for f in files if (why := not_ended(f)) is not None}
        if files and not unfinished:
            return files
        if time.monotonic() > deadline:
            raise AssertionError(f"W&B run files not ended after {timeout_s:.0f} s: "
                                 f"{unfinished or 'no run file under ' + str(workdir)}")  # fmt: skip
        time.sleep(0.2)


def not_ended(run_file: Path) -> str | None:
    """None once the file's last record is the run's `exit`; else why not (the last record's type, or
    the error reading it: a record still being written fails to parse until it is whole)."""
    try:
        records = wandb_records(run_file)
    except Exception as err:
        return f"unreadable: {type(err).__name__}: {err}"
    last = records[-1].WhichOneof("record_type") if records else None
    return None if last == "exit" else f"last record: {last}"


def wandb_history(workdir: Path) -> dict[int, dict[str, Any]]:
    """Every logged step of every offline run of the job folder, merged: {step: {key: value}}."""
    rows: dict[int, dict[str, Any]] = {}
    for run_file in wandb_run_files(workdir):
        for record in wandb_records(run_file):
            if record.WhichOneof("record_type") == "history":
                items = {
                    i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item
                }
                rows.setdefault(int(items["_step"]), {}).update(items)
    return rows


def wandb_config(workdir: Path) -> dict[str, Any]:
    config: dict[str, Any] = {}
    for run_file in wandb_run_files(workdir):
        for record in wandb_records(run_file):
            kind = record.WhichOneof("record_type")
            updates = (
                record.config.update
                if kind == "config"
                else record.run.config.update
                if kind == "run"
                else []
            )
            config.update({u.key: json.loads(u.value_json) for u in updates})
    return config


def wandb_run_ids(workdir: Path) -> set[str]:
    return {f.name.removeprefix("run-").removesuffix(".wandb") for f in wandb_run_files(workdir)}


def wandb_tables(workdir: Path) -> list[dict[str, Any]]:
    wandb_run_files(workdir)  # every run written out
    return [
        json.loads(f.read_text())
        for f in sorted(workdir.glob("wandb/offline-run-*/files/media/table/*.json"))
    ]


def mlflow_client(uri: str):
    import os

    from mlflow.tracking import MlflowClient

    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")  # a local folder, as the tracker wrote it

    return MlflowClient(tracking_uri=uri)
