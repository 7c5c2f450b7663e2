"""A split placement's lost rollout worker, replaced alone while the training ranks keep running.

Split rollout workers hold no training state (the base model plus the weights last sent), so when one
dies while every training rank answers, `replace_lost_rollout` starts a new rollout group, connects
the training rank 0 to it anew and sends the current weights; the trainer retries what failed. It
counts against trainer.max_restarts; a replacement that fails falls back to the whole-job restart.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from controller.recovery import Recovery, WorkerLost, find_dead, worker_lost
from controller.roles import TRANSFER_TIMEOUT_S
from controller.sink import JobSink
from controller.worker_group import wait_all

if TYPE_CHECKING:
    from controller.roles import JobGroups
    from schema.training import TrainerSpec


def rollout_lost(err: BaseException, groups: JobGroups) -> WorkerLost | None:
    """The lost worker `err` reports when it is a split placement's rollout worker alone, else None."""
    rollout = groups.actor.own_rollout
    if rollout is None or isinstance(err, WorkerLost):
        return None
    lost = worker_lost(err, groups)
    if lost is None or lost.group != rollout.name:
        return None
    dead = find_dead(groups)
    if any(group != rollout.name for group, _, _ in dead):
        return None
    return lost


def replace_lost_rollout(
    err: BaseException, groups: JobGroups, recovery: Recovery, sink: JobSink, step: int, trainer: TrainerSpec
) -> dict[str, float]:
    """Replace the rollout group when `err` is its worker's loss alone (else re-raise `err`); returns
    the transfer's measurements. A replacement that fails is a WorkerLost (a whole-job restart)."""
    lost = rollout_lost(err, groups)
    if lost is None:
        raise err
    recovery.begin_replacement(lost)  # RestartsExhausted past trainer.max_restarts
    try:
        groups.replace_rollout(start_timeout_s=min(trainer.restart_wait_s, TRANSFER_TIMEOUT_S))
        synced: dict[str, Any] = groups.actor.sync_weights()
        rollout = groups.actor.own_rollout
        pids = wait_all(rollout.name, "pid", [a.pid.remote() for a in rollout.actors], 30.0)
    except Exception as failed:
        recovery.replacement_failed()
        raise WorkerLost(
            "could not be replaced",
            f"{lost.error}; replacing the rollout group '{lost.group}' failed: {type(failed).__name__}: {failed}",
            lost.group,
            lost.rank,
        ) from failed
    recovery.replaced_rollout(lost, sink, step, pids=pids, weight_version=synced.get("weight_sync/version"))
    return synced
