"""Putting a freshly built model folder in place atomically, when other processes may build it too.

A build writes a staging folder beside the target and renames it into place: a reader sees no
folder or a whole one; when another process got there first with the same build, its folder is kept.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import uuid
from collections.abc import Callable
from pathlib import Path


def staging_folder(folder: Path) -> Path:
    """A new, empty folder beside `folder` (same file system, so the rename is atomic)."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f".{folder.name}.staging-", dir=folder.parent))


def install(staging: Path, folder: Path, is_current: Callable[[Path], bool], tries: int = 5) -> Path:
    """Rename `staging` to `folder`. An existing `folder` for which `is_current` holds is kept (staging
    removed); any other is moved aside and removed. Returns `folder`."""
    try:
        for _ in range(tries):
            try:
                staging.rename(folder)  # atomic when `folder` is absent (or an empty directory)
                return folder
            except OSError:
                if not folder.exists():
                    continue  # removed between the two calls: try again
            if is_current(folder):
                return folder  # another process built the same thing first
            aside = folder.with_name(f".{folder.name}.old-{uuid.uuid4().hex[:8]}")
            try:
                os.rename(folder, aside)
            except OSError:
                continue  # someone else is replacing it: look again
            shutil.rmtree(aside, ignore_errors=True)
        raise OSError(f"could not put the model folder in place at {folder} after {tries} tries")
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)


def build_atomically(
    folder: Path, marker: str, wanted: dict, build: Callable[[Path], None], overwrite: bool = False
) -> Path:
    """`folder` as `build(staging)` writes it, then the `marker` file holding `wanted`; a folder whose
    marker holds `wanted` already is kept (unless `overwrite`)."""

    def is_current(path: Path) -> bool:
        file = path / marker
        return not overwrite and file.exists() and json.loads(file.read_text()) == wanted

    if is_current(folder):
        return folder
    staging = staging_folder(folder)
    try:
        build(staging)
        (staging / marker).write_text(json.dumps(wanted, indent=2))
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return install(staging, folder, is_current)
