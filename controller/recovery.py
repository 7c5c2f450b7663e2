"""Recovery: a job that survives its workers.

When a worker of a job is lost (its process is gone, its node died, or a call to it timed out), the
job's controller restarts instead of failing: it tears every worker group down with their placement
group, waits a backoff (`trainer.restart_backoff_s`, doubled each time), waits for the cluster to have
room for the workers again (at most `trainer.restart_wait_s`), starts them afresh, loads the last
committed checkpoint and goes on. After `trainer.max_restarts` restarts the next loss fails the job
with every error on record. The trainer drives this (`Trainer.run`); this module decides and records:

- `worker_lost(err, groups)`: whether an error means a lost worker (retried) or is the job's own
  (never retried): a rank that raised, a reward function that raised, a bad spec, a missing file.
  A rank that raised because a peer died under it (a collective fails on every rank) counts as the
  peer's loss: the ranks are pinged before an error is called the job's own.
- `Recovery`: the restart budget, the backoff, the bounded wait for capacity, the losses so far, and
  the status the service shows while a restart is under way (`restarting (1/3): worker rank 0 died`).
- `AttemptSink`: events and samples made after a restart carry the attempt number (2, 3, ...); the
  metric rows of the steps after the checkpoint are replaced (`JobSink.rewind`), one row per step.

The scope of a restart is the whole job: with colocated roles every process holds a training rank,
so a lost process takes the job's training state with it. A split placement's rollout worker lost
alone is replaced without a restart (controller/rollout_recovery.py), within the same budget
(`Recovery.begin_replacement`); anything else falls back to this one (docs/ARCHITECTURE.md §6.1).
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

from controller.groups import RoleGroup
from controller.resource_pool import ResourcePool, ResourcePoolError
from controller.sink import JobSink
from controller.worker_group import RayWorkerGroup, WorkerGroupError, wait_all
from schema.resources import ResourcesSpec
from schema.training import TrainerSpec

if TYPE_CHECKING:
    from controller.roles import JobGroups

log = logging.getLogger("tandem.job")

# Ray's own failures of a process, a node or a placement: the worker is gone, the job's code is not
# at fault. (A RayTaskError is a raise inside a worker: the job's own.)
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
    """A worker of the job is gone: the job restarts (within its budget) instead of failing."""

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
    """The job lost a worker once more than trainer.max_restarts allows; every loss is listed."""

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
    if isinstance(err, WorkerGroupError):
        if err.kind == "died":
            return WorkerLost("died", str(err), err.group, err.rank)
        if err.kind == "timeout":
            return WorkerLost("did not answer in time", str(err), err.group, err.rank)
        return _peer_died(err, groups)  # a rank raised: its own error, unless a peer died under it
    if isinstance(err, RayTaskError):  # raised in another actor of the job (its endpoint, say)
        return _peer_died(err, groups)
    if isinstance(err, _LOST):
        cause = "could not be placed" if isinstance(err, ResourcePoolError) else "died"
        return WorkerLost(cause, f"{type(err).__name__}: {err}")
    return None


def _peer_died(err: BaseException, groups: JobGroups | None) -> WorkerLost | None:
    """A lost worker when one of the job's workers is dead (a collective, or a call waiting on the dead
    worker, fails with the death as its cause); else None: the error is the job's own."""
    dead = find_dead(groups) if groups is not None else []
    if not dead:
        return None
    group, rank, why = dead[0]
    return WorkerLost("died", f"{err} (after worker group '{group}', rank {rank} died: {why})", group, rank)


def worker_groups(groups: JobGroups) -> dict[str, RayWorkerGroup]:
    """Every worker group of the job by role: the JobGroups fields that hold a role's group, and
    "rollout" for a split placement's rollout group (the actor's, placed apart)."""
    found = {
        f.name: value.group
        for f in dataclasses.fields(groups)
        if isinstance(value := getattr(groups, f.name), RoleGroup)
    }
    rollout = groups.actor.own_rollout
    if rollout is not None:
        found["rollout"] = rollout
    return found


def find_dead(groups: JobGroups, timeout_s: float = PING_TIMEOUT_S) -> list[tuple[str, int, str]]:
    """(group, rank, why) of every worker actor Ray reports dead. A rank busy past the timeout is not
    called dead: only Ray's word that the process is gone counts."""
    where: dict[Any, tuple[str, int]] = {}
    for group in worker_groups(groups).values():
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


def worker_pids(groups: JobGroups, timeout_s: float = 30.0) -> dict[str, list[int]]:
    """The process id of every rank of every worker group, by role."""
    return {
        role: wait_all(group.name, "pid", [a.pid.remote() for a in group.actors], timeout_s)
        for role, group in worker_groups(groups).items()
    }


class Recovery:
    """The restart budget and record of one job, and the status shown while a restart is under way."""

    def __init__(self, spec: TrainerSpec, earlier: int = 0) -> None:
        """`earlier`: the job's restarts before this run of its controller (the scheduler's, when a
        controller died, and its predecessors'): the budget is the job's."""
        self.max_restarts, self.backoff_s, self.wait_s = (
            spec.max_restarts,
            spec.restart_backoff_s,
            spec.restart_wait_s,
        )
        self.earlier = earlier
        self.losses: list[WorkerLost] = []  # every loss of this run, restarts and replacements, in order
        self.replaced = 0  # of them, rollout workers replaced alone (controller/rollout_recovery.py)
        self.status: dict[str, Any] | None = None  # set from a loss until the job resumed

    @property
    def restarts(self) -> int:
        """Restarts of the whole job (`job/restarts`); a rollout worker replaced alone is not one."""
        return self.earlier + len(self.losses) - self.replaced

    @property
    def used(self) -> int:
        """Losses counted against trainer.max_restarts: restarts and rollout replacements."""
        return self.earlier + len(self.losses)

    @property
    def attempt(self) -> int:
        """1 for the first run of the workers, 2 after the first restart, ..."""
        return self.restarts + 1

    def begin(
        self, lost: WorkerLost, sink: JobSink, step: int, resume_step: int, checkpoint: Path | None
    ) -> None:
        """Record the loss (at `step`, the step being run); raise RestartsExhausted when the budget is
        spent, else announce the restart (its event marks the charts at `step`)."""
        n, most = self._count(lost)
        message = f"restarting ({n}/{most}): {lost.summary}"
        self.status = {
            "message": message,
            "phase": "backing off",
            "restart": n,
            "max_restarts": most,
            "attempt": self.attempt,
            "cause": lost.summary,
            "resume_step": resume_step,
            "since": time.time(),
        }
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
        """A split placement's rollout worker is being replaced alone: counted against the same
        budget (RestartsExhausted past it); the status says so until `replaced`."""
        n, most = self._count(lost)
        self.replaced += 1
        self.status = {
            "message": f"replacing a rollout worker ({n}/{most}): {lost.summary}",
            "phase": "replacing rollout worker",
            "restart": n,
            "max_restarts": most,
            "attempt": self.attempt,
            "cause": lost.summary,
            "since": time.time(),
        }

    def replaced_rollout(self, lost: WorkerLost, sink: JobSink, step: int, **data: Any) -> None:
        """The replacement is up with the current weights: a `rollout_replaced` event, status cleared."""
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

    def replacement_failed(self) -> None:
        """The replacement did not come up: its loss is taken back (the restart after it counts it)."""
        self.losses.pop()
        self.replaced -= 1
        self.status = None

    def _count(self, lost: WorkerLost) -> tuple[int, int]:
        """Record a loss; (losses counted, max_restarts), or RestartsExhausted past the budget."""
        self.losses.append(lost)
        n, most = self.used, self.max_restarts
        if n > most:
            self.status = None
            raise RestartsExhausted(self.losses, most, self.earlier) from lost
        return n, most

    def wait(self, resources: ResourcesSpec, name: str, should_stop: Callable[[], str | None]) -> None:
        """The backoff, then until the cluster can place the job's workers again (bounded); both end
        early when `should_stop()` names a stop request (the caller then stops)."""
        backoff = self.backoff_s * 2 ** (self.restarts - 1)
        deadline = time.monotonic() + backoff
        while time.monotonic() < deadline and should_stop() is None:
            time.sleep(min(0.2, max(deadline - time.monotonic(), 0)))
        self._phase("waiting for resources")
        wait_for_capacity(resources, name, self.wait_s, should_stop)
        self._phase("starting workers")

    def resumed(self) -> None:
        """The workers are up and the checkpoint loaded: no restart under way any more."""
        self.status = None

    def _phase(self, phase: str) -> None:
        if self.status is not None:
            self.status = {**self.status, "phase": phase}


def wait_for_capacity(
    resources: ResourcesSpec, name: str, timeout_s: float, should_stop: Callable[[], str | None]
) -> None:
    """Until a placement group of the job's shape can be scheduled (then removed again: the job's own
    is made by its start), `should_stop()` says stop, or `timeout_s` passed (ResourcePoolError)."""
    deadline = time.monotonic() + timeout_s
    while should_stop() is None:
        remaining = deadline - time.monotonic()
        try:
            # The job's pool name: the scheduler removes a pool left behind by a controller that died.
            ResourcePool.for_resources(
                resources, name=f"{name}-pool", ready_timeout_s=min(5.0, max(remaining, 0.1))
            ).remove()
            return
        except ResourcePoolError:
            if deadline - time.monotonic() <= 0:
                raise ResourcePoolError(
                    f"no room for the job's {resources.workers} worker(s) within trainer.restart_wait_s "
                    f"({timeout_s:.0f}s); the cluster has {ray.available_resources()} available"
                ) from None


class AttemptSink:
    """A JobSink that marks the events and samples of a restarted job with their attempt (2, 3, ...);
    the first attempt's records carry no mark. Everything else goes to the sink it wraps."""

    def __init__(self, sink: JobSink) -> None:
        self.inner = sink
        self.attempt = 1

    def event(self, kind: str, message: str, **data: Any) -> None:
        if self.attempt > 1:
            data.setdefault("attempt", self.attempt)
        self.inner.event(kind, message, **data)

    def metrics(self, step: int, values: dict[str, float]) -> None:
        self.inner.metrics(step, values)

    def progress(self, step: int, total: int, values: dict[str, float]) -> None:
        self.inner.progress(step, total, values)

    def samples(self, step: int, rows: list[dict[str, Any]]) -> None:
        if self.attempt > 1:
            rows = [{**row, "attempt": self.attempt} for row in rows]
        self.inner.samples(step, rows)

    def flush(self) -> None:
        self.inner.flush()

    def rewind(self, step: int) -> None:
        self.inner.rewind(step)
