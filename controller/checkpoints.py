"""A job's checkpoints: the workers' engine states plus the trainer's own state, under one step folder.

Layout: `<workdir>/checkpoints/step_<N>/{actor,critic}/...` written by the workers (each atomically),
then `trainer_state.json` (step, data position, KL coefficient), written last through a rename:
a step folder without it is incomplete and never resumed from. Retention keeps the newest
`checkpoint.keep_last` complete folders.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

from controller.spec import JobSpec
from engines import checkpoint as ckpt

if TYPE_CHECKING:
    from controller.trainer import Trainer

STATE_FILE = "trainer_state.json"


def root(workdir: Path) -> Path:
    return Path(workdir) / "checkpoints"


def complete(workdir: Path) -> list[tuple[int, Path]]:
    """(step, folder) of the complete checkpoints of a job, oldest first."""
    return [(s, p) for s, p in ckpt.list_checkpoints(root(workdir)) if (p / STATE_FILE).exists()]


def save(trainer: Trainer, step: int) -> Path:
    folder = ckpt.step_dir(root(trainer.workdir), step)
    if folder.exists():
        shutil.rmtree(folder)  # a leftover of an interrupted save of the same step
    folder.mkdir(parents=True)
    groups = trainer.job.groups
    groups.actor.save_checkpoint(str(folder), step)
    if groups.critic is not None:
        groups.critic.save_checkpoint(str(folder), step)
    state = {"step": step, "loader": trainer.job.loader.state_dict(), "kl_coef": trainer.kl.value}
    tmp = folder / (STATE_FILE + ".tmp")
    tmp.write_text(json.dumps(state, indent=2))
    tmp.replace(folder / STATE_FILE)
    for _step, old in complete(trainer.workdir)[: -trainer.spec.checkpoint.keep_last]:
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


def load(trainer: Trainer, folder: Path) -> int:
    state = json.loads((folder / STATE_FILE).read_text())
    groups = trainer.job.groups
    groups.actor.load_checkpoint(str(folder))
    # The spec's learning rate wins over the checkpoint's: an edit made while paused, or a fork's override.
    groups.actor.set_hyperparameters(lr=trainer.spec.optim.lr)
    if groups.critic is not None:
        groups.critic.load_checkpoint(str(folder))
        groups.critic.set_hyperparameters(lr=trainer.spec.algorithm.critic_lr)
    trainer.job.loader.load_state_dict(state["loader"])
    trainer.kl.value = state["kl_coef"]
    return int(state["step"])
