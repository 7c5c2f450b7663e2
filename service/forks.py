"""Forks: a new job that resumes a private copy of one of its parent's checkpoints.

The copy (hard links where the file system allows) lives under jobs/fork-sources/, so the parent
may keep running and prune the original before the child starts.
"""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path
from typing import Any

from schema.job import JobSpec
from service.errors import ServiceError
from service.owned_paths import FORK_SOURCES
from service.store import JobStore


def same_weights_shape(parent: JobSpec, child: JobSpec) -> None:
    """A fork keeps the parent's base model and, with LoRA, its adapter shape (a checkpoint of rank-8
    adapters cannot load into rank-16 ones)."""
    before, after = parent.model.lora, child.model.lora
    kept = [
        (f"model.{f}", getattr(parent.model, f), getattr(child.model, f), "base model")
        for f in ("path", "builtin")
    ]
    kept.append(("model.lora", before is None, after is None, "choice of LoRA or full fine-tuning"))
    if before is not None and after is not None:
        for f in ("rank", "target_modules"):
            shape = f"adapter shape ({f} = {getattr(before, f)})"
            kept.append((f"model.lora.{f}", getattr(before, f), getattr(after, f), shape))
    for param, was, now, what in kept:
        if was != now:
            raise ServiceError(f"{param}: a fork keeps its parent's {what}", 422, param, "invalid_value")


def fork_point(store: JobStore, job_id: str, step: int | None) -> dict[str, Any]:
    """The checkpoint to fork from: the one at `step`, or the latest."""
    saved = store.checkpoints(job_id)
    if not saved:
        raise ServiceError(f"job '{job_id}' has no checkpoint to fork from", 409, "job_id", "no_checkpoint")
    chosen = saved[-1] if step is None else next((c for c in saved if c["step"] == step), None)
    if chosen is None:
        raise ServiceError(f"job '{job_id}' has no checkpoint at step {step}; it has {[c['step'] for c in saved]}",
                           404, "checkpoint_step", "not_found")  # fmt: skip
    return chosen


def snapshot_checkpoint(jobs_root: Path, folder: Path) -> Path:
    """The fork's private copy of `folder` (FileNotFoundError, and no copy, when it goes meanwhile)."""
    target = jobs_root / FORK_SOURCES / uuid.uuid4().hex[:12] / folder.name

    def link_or_copy(src: str, dst: str) -> None:
        try:
            os.link(src, dst)
        except OSError:
            shutil.copy2(src, dst)

    try:
        shutil.copytree(folder, target, copy_function=link_or_copy)
    except (FileNotFoundError, shutil.Error):  # files went while they were copied: pruned, or the job deleted
        shutil.rmtree(target.parent, ignore_errors=True)
        raise FileNotFoundError(f"checkpoint {folder} went while it was copied") from None
    return target


def fork_source(jobs_root: Path, path: str | None) -> Path | None:
    """The folder of a fork's private checkpoint copy that `path` (a resume_from) names, if it names one."""
    copy = Path(path).resolve() if path else None
    return copy.parent if copy and copy.parent.parent == (jobs_root / FORK_SOURCES).resolve() else None


def remove_fork_source(jobs_root: Path, path: str | None) -> None:
    """Remove a fork's private checkpoint copy (only ever one under jobs/fork-sources/)."""
    if (folder := fork_source(jobs_root, path)) is not None:
        shutil.rmtree(folder, ignore_errors=True)
