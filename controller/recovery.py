"""Recovery: a job that survives its workers. The trainer drives the restart (`Trainer.run`); here
`worker_lost` decides whether an error is a lost worker (retried; a rank that raised because a peer
died, or because a rollout worker stopped answering in its weight transfer, counts as the peer's loss)
or the job's own, `Recovery` keeps the restart budget, backoff and
status, and `AttemptSink` marks what a restarted attempt records.

A split placement's rollout workers hold no training state, so one that dies while every training
rank answers is replaced alone (`Recovery.replace_rollout`: a new rollout group, connected anew and sent
the current weights) within the same budget; a replacement that fails falls back to the restart.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import ray
from ray.exceptions import (
    ActorPlacementGroupRemoved,
    ActorUnschedulableError,
    GetTimeoutError,
    LocalRayletDiedError,
    NodeDiedError,
    ObjectLostError,
    OutOfMemoryError,
    RayActorError,
    RayError,
    RayTaskError,
    TaskPlacementGroupRemoved,
    WorkerCrashedError,
)

from controller.groups import TRANSFER_TIMEOUT_S
from controller.resource_pool import ResourcePool, ResourcePoolError
from controller.sink import JobSink
from controller.worker_group import RayWorkerGroup, RoleGroup, WorkerGroupError
from engines.transfer.base import TransferTimeout
from schema.resources import ResourcesSpec
from schema.training import TrainerSpec

if TYPE_CHECKING:
    from controller.groups import JobGroups

log = logging.getLogger("tandem.job")

# Ray's own failures of a process, a node or a placement (a RayTaskError is the job's own raise).
_LOST = (
    RayActorError,
    NodeDiedError,
    LocalRayletDiedError,
    WorkerCrashedError,
    ObjectLostError,
    OutOfMemoryError,
    GetTimeoutError,
    ActorPlacementGroupRemoved,
    ActorUnschedulableError,
    TaskPlacementGroupRemoved,
    ResourcePoolError,
)
PING_TIMEOUT_S = 10.0


class WorkerLost(Exception):
    """A worker of the job is gone: the job restarts (within its budget)."""

    def __init__(self, cause: str, error: str, group: str | None = None, rank: int | None = None) -> None:
        super().__init__(error)
        self.cause, self.error, self.group, self.rank = cause, error, group, rank

    @property
    def summary(self) -> str:
        """What a person reads first: 'worker rank 0 died'."""
        who = f"worker rank {self.rank}" if self.rank is not None else "a worker"
        return f"{who} {self.cause}"

    def record(self) -> dict[str, Any]:
        return {"cause": self.cause, "group": self.group, "rank": self.rank, "error": self.error}


class RestartsExhausted(RuntimeError):
    """The job lost a worker once more than trainer.max_restarts allows."""

    def __init__(self, losses: list[WorkerLost], max_restarts: int, earlier: int = 0) -> None:
        listed = "; ".join(f"[attempt {i}] {lost.error}" for i, lost in enumerate(losses, earlier + 1))
        super().__init__(
            f"the job lost a worker {earlier + len(losses)} time(s), more than trainer.max_restarts "
            f"({max_restarts}) allows: {listed}"
        )
        self.losses = list(losses)


def worker_lost(err: BaseException, groups: JobGroups | None) -> WorkerLost | None:
    """The lost worker `err` reports, or None when `err` is the job's own error (never retried)."""
    if isinstance(err, WorkerLost):
        return err
    if (silent := _transfer_timeout(err)) is not None:  # a sender named the receiver that went silent
        slow = (
            "a receiver merely slower than the transfer's limit (from trainer.call_timeout_s) reads the same"
        )
        cause = "stopped answering in a weight transfer"
        return WorkerLost(cause, f"{err}; {slow}", silent.group, silent.rank)
    if isinstance(err, WorkerGroupError):
        if err.kind == "died":
            return WorkerLost("died", str(err), err.group, err.rank)
        if err.kind == "hung":
            slow = "a rank merely slower than trainer.collective_timeout_s reads the same: raise it"
            return WorkerLost("hung", f"{err}; {slow}", err.group, err.rank)
        if err.kind == "timeout":
            slow = "a worker merely slower than its limit reads the same (a step's calls: trainer.call_timeout_s)"
            return WorkerLost("did not answer in time", f"{err}; {slow}", err.group, err.rank)
        return _peer_died(err, groups)  # a rank raised: its own error, unless a peer died under it
    if isinstance(err, RayTaskError):  # raised in another actor of the job (its endpoint, say)
        return _peer_died(err, groups)
    if isinstance(err, _LOST):
        cause = "could not be placed" if isinstance(err, ResourcePoolError) else "died"
        return WorkerLost(cause, f"{type(err).__name__}: {err}")
    return None


def _transfer_timeout(err: BaseException) -> TransferTimeout | None:
    """The TransferTimeout a rank raised (Ray's RayTaskError holds it as `cause`), if `err` is one."""
    seen: BaseException | None = err
    for _ in range(4):  # WorkerGroupError <- RayTaskError(cause=TransferTimeout): a short chain
        if seen is None:
            return None
        raised = getattr(seen, "cause", None)  # a RayTaskError's: what the worker raised
        if isinstance(raised, TransferTimeout):
            return raised
        if isinstance(seen, TransferTimeout):
            return seen
        seen = seen.__cause__
    return None


def _peer_died(err: BaseException, groups: JobGroups | None) -> WorkerLost | None:
    """A lost worker when one of the job's workers is dead (a collective fails on every rank), else None."""
    dead = find_dead(groups) if groups is not None else []
    if not dead:
        return None
    group, rank, why = dead[0]
    return WorkerLost("died", f"{err} (after worker group '{group}', rank {rank} died: {why})", group, rank)


def worker_groups(groups: JobGroups) -> dict[str, RayWorkerGroup]:
    """Every worker group of the job by role, with "rollout" for a split placement's rollout group."""
    found = {
        f.name: value.group
        for f in dataclasses.fields(groups)
        if isinstance(value := getattr(groups, f.name), RoleGroup)
    }
    rollout = groups.actor.own_rollout
    if rollout is not None:
        found["rollout"] = rollout
    return found


def find_dead(
    groups: JobGroups, timeout_s: float = PING_TIMEOUT_S, skip: str | None = None
) -> list[tuple[str, int, str]]:
    """(group, rank, why) of every worker actor Ray reports dead (a rank merely busy is not dead), the
    group named `skip` left out."""
    where: dict[Any, tuple[str, int]] = {}
    for group in worker_groups(groups).values():
        if group.name == skip:
            continue
        for rank, actor in enumerate(group.actors):
            where[actor.pid.remote()] = (group.name, rank)
    ready, _ = ray.wait(list(where), num_returns=len(where), timeout=timeout_s)
    dead = []
    for ref in ready:
        try:
            ray.get(ref, timeout=1)
        except RayError as err:
            dead.append((*where[ref], type(err).__name__))
    return sorted(dead, key=lambda d: (d[0], d[1]))


def worker_pids(groups: JobGroups) -> dict[str, list[int]]:
    return {role: group.pids() for role, group in worker_groups(groups).items()}


class Recovery:
    """The restart budget and record of one job, and the status shown while a restart is under way."""

    def __init__(self, spec: TrainerSpec, earlier: int = 0) -> None:
        self.max_restarts, self.backoff_s = spec.max_restarts, spec.restart_backoff_s
        self.wait_s = spec.restart_wait_s
        self.earlier = earlier  # the job's restarts before this run of its controller
        self.losses: list[WorkerLost] = []  # every loss of this run, restarts and replacements, in order
        self.replaced = 0  # of them, rollout workers replaced alone
        self.status: dict[str, Any] | None = None  # set from a loss until the job resumed

    @property
    def restarts(self) -> int:
        """Restarts of the whole job; a rollout worker replaced alone is not one."""
        return self.earlier + len(self.losses) - self.replaced

    @property
    def used(self) -> int:
        """Losses counted against trainer.max_restarts: restarts and rollout replacements."""
        return self.earlier + len(self.losses)

    @property
    def attempt(self) -> int:
        return self.restarts + 1

    def begin(
        self, lost: WorkerLost, sink: JobSink, step: int, resume_step: int, checkpoint: Path | None
    ) -> None:
        """Record the loss at `step`; RestartsExhausted past the budget, else announce the restart."""
        n, most = self._count(lost)
        message = f"restarting ({n}/{most}): {lost.summary}"
        self._set_status(message, "backing off", lost, resume_step=resume_step)
        origin = f"checkpoint step {resume_step}" if checkpoint is not None else "the start"
        sink.event(
            "restart",
            f"{message}; resuming from {origin}: {lost.error}",
            **lost.record(),
            restart=n,
            max_restarts=most,
            attempt=self.attempt,
            step=step,
            resume_step=resume_step,
            checkpoint=str(checkpoint) if checkpoint is not None else None,
        )
        log.warning("%s (%s)", message, lost.error)

    def begin_replacement(self, lost: WorkerLost) -> None:
        """A split placement's rollout worker is being replaced alone, within the same budget."""
        n, most = self._count(lost)
        self.replaced += 1
        message = f"replacing a rollout worker ({n}/{most}): {lost.summary}"
        self._set_status(message, "replacing rollout worker", lost)

    def _set_status(self, message: str, phase: str, lost: WorkerLost, **extra: Any) -> None:
        self.status = dict(message=message, phase=phase, restart=self.used, max_restarts=self.max_restarts)
        self.status.update(attempt=self.attempt, cause=lost.summary, **extra, since=time.time())

    def replaced_rollout(self, lost: WorkerLost, sink: JobSink, step: int, **data: Any) -> None:
        n, most = self.used, self.max_restarts
        message = f"replaced a rollout worker ({n}/{most}): {lost.summary}; the training ranks kept running"
        sink.event(
            "rollout_replaced",
            f"{message}: {lost.error}",
            **lost.record(),
            replacement=self.replaced,
            restart=n,
            max_restarts=most,
            step=step,
            **data,
        )
        log.warning("%s (%s)", message, lost.error)
        self.status = None

    def replace_rollout(
        self, err: BaseException, groups: JobGroups, sink: JobSink, step: int
    ) -> dict[str, float]:
        """Replace the rollout group when `err` is its worker's loss alone (else re-raise `err`); returns
        the transfer's measurements. A replacement that fails is a WorkerLost (a whole-job restart)."""
        lost = rollout_lost(err, groups)
        if lost is None:
            raise err
        self.begin_replacement(lost)  # RestartsExhausted past trainer.max_restarts
        try:
            groups.replace_rollout(start_timeout_s=min(self.wait_s, TRANSFER_TIMEOUT_S))
            synced: dict[str, Any] = groups.actor.sync_weights()
            pids = groups.actor.own_rollout.pids()
        except Exception as failed:
            self.replacement_failed()
            raise WorkerLost(
                "could not be replaced",
                f"{lost.error}; replacing the rollout group '{lost.group}' failed: {type(failed).__name__}: {failed}",
                lost.group,
                lost.rank,
            ) from failed
        self.replaced_rollout(lost, sink, step, pids=pids, weight_version=synced.get("weight_sync/version"))
        return synced

    def replacement_failed(self) -> None:
        """The replacement did not come up: the restart after it counts the loss."""
        self.losses.pop()
        self.replaced -= 1
        self.status = None

    def _count(self, lost: WorkerLost) -> tuple[int, int]:
        self.losses.append(lost)
        n, most = self.used, self.max_restarts
        if n > most:
            self.status = None
            raise RestartsExhausted(self.losses, most, self.earlier) from lost
        return n, most

    def wait(
        self, resources: ResourcesSpec, name: str, should_stop: Callable[[], str | None]
    ) -> ResourcePool | None:
        """The backoff, then the job's training pool placed again (None when `should_stop()` named a
        stop request first): the next attempt starts its workers on it."""
        backoff = self.backoff_s * 2 ** (self.restarts - 1)
        deadline = time.monotonic() + backoff
        while time.monotonic() < deadline and should_stop() is None:
            time.sleep(min(0.2, max(deadline - time.monotonic(), 0)))
        self._phase("waiting for resources")
        pool = wait_for_capacity(resources, name, self.wait_s, should_stop)
        self._phase("starting workers")
        return pool

    def resumed(self) -> None:
        self.status = None

    def _phase(self, phase: str) -> None:
        if self.status is not None:
            self.status = {**self.status, "phase": phase}


def wait_for_capacity(
    resources: ResourcesSpec, name: str, timeout_s: float, should_stop: Callable[[], str | None]
) -> ResourcePool | None:
    """The job's training pool once the cluster can schedule it; None on a stop; ResourcePoolError
    past `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while should_stop() is None:
        remaining = deadline - time.monotonic()
        try:
            # The job's pool name: the scheduler removes a pool left behind by a controller that died.
            return ResourcePool.for_resources(
                resources, name=f"{name}-pool", ready_timeout_s=min(5.0, max(remaining, 0.1))
            )
        except ResourcePoolError:
            if deadline - time.monotonic() <= 0:
                raise ResourcePoolError(
                    f"no room for the job's {resources.workers} worker(s) within trainer.restart_wait_s "
                    f"({timeout_s:.0f}s); the cluster has {ray.available_resources()} available"
                ) from None
    return None


class AttemptSink:
    """A JobSink that marks the events and samples of a restarted job with their attempt (2, 3, ...)."""

    def __init__(self, sink: JobSink) -> None:
        self.inner = sink
        self.attempt = 1

    def __getattr__(self, name: str) -> Any:  # metrics, progress, flush, rewind: as they are
        return getattr(self.inner, name)

    def event(self, kind: str, message: str, **data: Any) -> None:
        if self.attempt > 1:
            data.setdefault("attempt", self.attempt)
        self.inner.event(kind, message, **data)

    def samples(self, step: int, rows: list[dict[str, Any]]) -> None:
        if self.attempt > 1:
            rows = [{**row, "attempt": self.attempt} for row in rows]
        self.inner.samples(step, rows)


def rollout_lost(err: BaseException, groups: JobGroups) -> WorkerLost | None:
    """The lost worker `err` reports when it is a split placement's rollout worker alone, else None."""
    rollout = groups.actor.own_rollout
    if rollout is None or isinstance(err, WorkerLost):
        return None
    lost = worker_lost(err, groups)
    if lost is None or lost.group != rollout.name:
        return None
    # Its own group is not pinged: a hung worker would hold the ping for the whole of its timeout.
    if find_dead(groups, skip=rollout.name):
        return None
    return lost
