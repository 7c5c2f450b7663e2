"""A job's checkpoints: `<workdir>/checkpoints/step_<N>/` holds the workers' engine states, then
`trainer_state.json` (`Trainer.state_dict()`), written last by a rename: a folder without it, or with
one that does not read back (a machine that died mid-write), is incomplete and never resumed from.
Retention keeps the newest `checkpoint.keep_last` complete ones.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from engines.training.checkpoint_paths import list_checkpoints, step_dir
from schema.job import JobSpec

if TYPE_CHECKING:
    from controller.groups import JobGroups

STATE_FILE = "trainer_state.json"
MAX_STATE_BYTES = 16 << 20  # read whole, at submission too


class SavedState(BaseModel):
    """What a resume reads of `trainer_state.json` (a `resume_from` an owner may have edited); the
    source's own keys pass through."""

    model_config = ConfigDict(extra="allow", strict=True)
    step: int = Field(ge=0)
    kl_coef: float = Field(allow_inf_nan=False)
    loader: dict[str, int]


def read_state(folder: Path) -> dict[str, Any]:
    """The trainer's state saved in `folder`; ValueError naming the file and the field at fault."""
    path = Path(folder) / STATE_FILE
    try:
        if not path.is_file() or path.stat().st_size > MAX_STATE_BYTES:  # a FIFO would block the read
            raise ValueError(f"not a regular file of at most {MAX_STATE_BYTES} bytes")
        state = json.loads(path.read_text())
        SavedState.model_validate(state)
    except ValidationError as err:
        fields = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in err.errors())
        raise ValueError(f"checkpoint state {path} cannot be resumed from: {fields}") from None
    except (OSError, ValueError) as err:
        raise ValueError(f"checkpoint state {path} cannot be resumed from: {err}") from None
    return state


def _committed(folder: Path) -> bool:
    """Whether `folder`'s state file reads back as a step's (the rename came after the write)."""
    try:
        state = json.loads((folder / STATE_FILE).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(state, dict) and type(state.get("step")) is int


def root(workdir: Path) -> Path:
    return Path(workdir) / "checkpoints"


def complete(workdir: Path) -> list[tuple[int, Path]]:
    return [(s, p) for s, p in list_checkpoints(root(workdir)) if _committed(p)]


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
    if not _committed(folder):  # else saved already (a job resumed at this step): a rewrite could lose it
        _write(folder, step, groups, trainer_state, before_commit)
    for _step, old in complete(workdir)[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)
    return folder


def _write(
    folder: Path,
    step: int,
    groups: JobGroups,
    trainer_state: dict[str, Any],
    before_commit: Callable[[], None],
) -> None:
    if folder.exists():
        shutil.rmtree(folder)  # a leftover of an interrupted save of the same step
    folder.mkdir(parents=True)
    groups.save_checkpoint(str(folder), step)
    before_commit()
    tmp = folder / (STATE_FILE + ".tmp")
    with tmp.open("w") as out:
        out.write(json.dumps(trainer_state, indent=2))
        out.flush()
        os.fsync(out.fileno())  # on disk before the rename marks the folder complete
    tmp.replace(folder / STATE_FILE)


def find_resume_folder(spec: JobSpec, workdir: Path) -> Path | None:
    """The job's own latest complete checkpoint, else `checkpoint.resume_from` (a fork's source)."""
    own = complete(workdir)
    if own:
        return own[-1][1]
    if spec.checkpoint.resume_from:
        folder = Path(spec.checkpoint.resume_from)
        if not (folder / STATE_FILE).exists():
            raise FileNotFoundError(f"checkpoint.resume_from '{folder}' is not a complete checkpoint folder")
        read_state(folder)
        return folder
    return None


def step_of(folder: Path) -> int:
    return int(read_state(folder)["step"])


def load(folder: Path, groups: JobGroups) -> dict[str, Any]:
    """Restore the workers' states from `folder`; returns the trainer's state saved with them."""
    state = read_state(folder)
    groups.load_checkpoint(str(folder))
    return state
