"""Checkpoint folders that are never half written, and Hugging Face exports.

A checkpoint is written into `<path>.tmp`, then swapped into place: the previous `<path>` is first
renamed to `<path>.old`, the new folder renamed to `<path>`, and only then is the old one deleted.
A crash at any point leaves either the new checkpoint or the previous one loadable:
`resolve_checkpoint` falls back to `<path>.old` when `<path>` is missing. Retention (`prune`) keeps
the newest k `step_*` folders under a root.
"""

from __future__ import annotations

import json
import random
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch

from engines.training.checkpoint_paths import list_checkpoints

META_FILE = "engine_meta.json"
FORMAT_VERSION = 1
# Files of a model folder that are weights; everything else (tokenizer, templates) is copied on export.
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".index.json")


def prune(root: str | Path, keep_last: int) -> list[Path]:
    """Delete all but the newest `keep_last` step folders; returns what was deleted."""
    if keep_last < 1:
        raise ValueError(f"keep_last must be at least 1, got {keep_last}")
    doomed = [p for _, p in list_checkpoints(root)[:-keep_last]]
    for path in doomed:
        shutil.rmtree(path, ignore_errors=True)
    return doomed


@contextmanager
def atomic_folder(path: str | Path, is_writer: bool, barrier: Callable[[], None]) -> Iterator[Path]:
    """Yield a temporary folder that replaces `path` only once every rank has finished writing."""
    final = Path(path)
    tmp, old = final.with_name(final.name + ".tmp"), final.with_name(final.name + ".old")
    if is_writer:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    barrier()
    yield tmp
    barrier()
    if is_writer:
        if final.exists():
            shutil.rmtree(old, ignore_errors=True)
            final.rename(old)
        tmp.rename(final)
        shutil.rmtree(old, ignore_errors=True)
    barrier()


def resolve_checkpoint(path: str | Path) -> Path:
    """The folder to load: `path`, or `<path>.old` if a crash interrupted the swap."""
    final = Path(path)
    if (final / META_FILE).exists():
        return final
    old = final.with_name(final.name + ".old")
    if (old / META_FILE).exists():
        return old
    raise FileNotFoundError(f"no complete checkpoint at '{path}' (missing {META_FILE})")


def rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def write_meta(folder: Path, meta: dict) -> None:
    (folder / META_FILE).write_text(json.dumps({"format_version": FORMAT_VERSION, **meta}, indent=2))


def read_meta(folder: Path) -> dict:
    return json.loads((folder / META_FILE).read_text())


def copy_tokenizer_files(source: str | Path, dest: Path) -> None:
    """Copy everything of a model folder that is not weights or config (tokenizer, chat template)."""
    for item in Path(source).iterdir():
        if (
            item.is_file()
            and not item.name.endswith(_WEIGHT_SUFFIXES)
            and item.name not in ("config.json", "tandem_spec.json")
        ):
            shutil.copy2(item, dest / item.name)
