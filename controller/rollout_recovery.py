"""A split placement's lost rollout worker, replaced alone while the training ranks keep running.

With `resources.placement: split` the rollout workers hold no training state: their engine is the
base model plus the weights the training rank 0 last sent. So when one dies (its process gone, or a
call to it timed out) while every training rank still answers, the job need not restart from its
checkpoint: `replace_lost_rollout` kills the rollout group, starts a new one on the rollout pool,
connects the training rank 0 to it anew (a collective strategy forms a new transfer group; the old
one is aborted, never waited on), and sends it the current weights with the job's transfer strategy.
The trainer then retries what failed: the same prompts generated again (the loader does not move),
or, when the loss surfaced in the step's weight sync, that replacement transfer is the sync.

Each wait is bounded (the start by `trainer.restart_wait_s`, at most TRANSFER_TIMEOUT_S; the
transfer by its strategy's timeout) and names the group on failure. A replacement counts against
`trainer.max_restarts` like a restart (past it the job fails with every loss), is a
`rollout_replaced` event (cause, group, rank, error, step, the new pids) and `job/rollout_replacements`
in the metrics; `job/restarts` counts whole-job restarts only. A loss that is not a rollout worker's
alone (a training rank is dead too), or a replacement that fails, falls back to the whole-job
restart (controller/recovery.py, `Trainer._recover`).
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
    """The lost rollout worker `err` reports when it is a split placement's rollout worker alone
    (every other worker answers a ping); None otherwise (the whole job restarts, or it fails)."""
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
    err: BaseException,
    groups: JobGroups,
    recovery: Recovery,
    sink: JobSink,
    step: int,
    trainer: TrainerSpec,
) -> dict[str, float]:
    """Replace the rollout group when `err` is its worker's loss alone (else re-raise `err`) and send
    it the current weights; returns that transfer's measurements (weight_sync/*). A replacement that
    fails is a WorkerLost: the caller's whole-job restart takes over."""
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
        recovery.replacement_failed()  # the whole-job restart that follows counts this loss once
        raise WorkerLost(
            "could not be replaced",
            f"{lost.error}; replacing the rollout group '{lost.group}' failed: {type(failed).__name__}: {failed}",
            lost.group,
            lost.rank,
        ) from failed
    recovery.replaced_rollout(lost, sink, step, pids=pids, weight_version=synced.get("weight_sync/version"))
    return synced
