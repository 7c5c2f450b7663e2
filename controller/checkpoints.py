"""A job's checkpoints: `<workdir>/checkpoints/step_<N>/` holds the workers' engine states, then
`trainer_state.json` (`Trainer.state_dict()`), written last by a rename: a folder without it is
incomplete and never resumed from. Retention keeps the newest `checkpoint.keep_last` complete ones.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from engines.training.checkpoint_paths import list_checkpoints, step_dir
from schema.job import JobSpec

if TYPE_CHECKING:
    from controller.groups import JobGroups

STATE_FILE = "trainer_state.json"


def root(workdir: Path) -> Path:
    return Path(workdir) / "checkpoints"


def complete(workdir: Path) -> list[tuple[int, Path]]:
    return [(s, p) for s, p in list_checkpoints(root(workdir)) if (p / STATE_FILE).exists()]


def save(
    workdir: Path,
    step: int,
    groups: JobGroups,
    trainer_state: dict[str, Any],
    keep_last: int,
    before_commit: Callable[[], None] = lambda: None,
) -> Path:
    """The workers' states, then `before_commit()` (the job's records are stored), then the trainer's."""
    folder = step_dir(root(workdir), step)
    if folder.exists():
        shutil.rmtree(folder)  # a leftover of an interrupted save of the same step
    folder.mkdir(parents=True)
    groups.save_checkpoint(str(folder), step)
    before_commit()
    tmp = folder / (STATE_FILE + ".tmp")
    tmp.write_text(json.dumps(trainer_state, indent=2))
    tmp.replace(folder / STATE_FILE)
    for _step, old in complete(workdir)[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)
    return folder


def find_resume_folder(spec: JobSpec, workdir: Path) -> Path | None:
    """The job's own latest complete checkpoint, else `checkpoint.resume_from` (a fork's source)."""
    own = complete(workdir)
    if own:
        return own[-1][1]
    if spec.checkpoint.resume_from:
        folder = Path(spec.checkpoint.resume_from)
        if not (folder / STATE_FILE).exists():
            raise FileNotFoundError(f"checkpoint.resume_from '{folder}' is not a complete checkpoint folder")
        return folder
    return None


def step_of(folder: Path) -> int:
    return int(json.loads((Path(folder) / STATE_FILE).read_text())["step"])


def load(folder: Path, groups: JobGroups) -> dict[str, Any]:
    """Restore the workers' states from `folder`; returns the trainer's state saved with them."""
    state = json.loads((folder / STATE_FILE).read_text())
    groups.load_checkpoint(str(folder))
    return state
