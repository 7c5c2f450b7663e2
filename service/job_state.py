"""A job's status and the one table of moves between statuses.

    queued ──▶ running ──▶ succeeded | failed | cancelled
      │  ▲        │ │
      │  │        │ └──▶ cancelling ──▶ cancelled (or succeeded / failed, if the run ended first)
      │  │        ▼
      │  └──── pausing ──▶ paused ──▶ queued (resume) | cancelled
      └──▶ paused | cancelled (before it ran)

A job goes back to queued when the service stops under it or its controller dies, and resumes from
its last checkpoint. `JobStore.transition` refuses a move this table does not list.
"""

from __future__ import annotations

from enum import StrEnum


class JobStatus(StrEnum):
    QUEUED = "queued"
    RUNNING = "running"
    PAUSING = "pausing"
    PAUSED = "paused"
    CANCELLING = "cancelling"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"


S = JobStatus
TRANSITIONS: dict[JobStatus, frozenset[JobStatus]] = {
    S.QUEUED: frozenset({S.RUNNING, S.PAUSED, S.CANCELLED}),
    S.RUNNING: frozenset({S.PAUSING, S.PAUSED, S.CANCELLING, S.QUEUED, S.SUCCEEDED, S.FAILED, S.CANCELLED}),
    S.PAUSING: frozenset({S.PAUSED, S.CANCELLING, S.QUEUED, S.SUCCEEDED, S.FAILED, S.CANCELLED}),
    S.CANCELLING: frozenset({S.CANCELLED, S.SUCCEEDED, S.FAILED}),
    S.PAUSED: frozenset({S.QUEUED, S.CANCELLED}),
    S.SUCCEEDED: frozenset(),
    S.FAILED: frozenset(),
    S.CANCELLED: frozenset(),
}

TERMINAL: tuple[JobStatus, ...] = tuple(s for s, nexts in TRANSITIONS.items() if not nexts)
# holding or waiting for the cluster
ACTIVE: tuple[JobStatus, ...] = (S.QUEUED, S.RUNNING, S.PAUSING, S.CANCELLING)
RUN_HOLDING: tuple[JobStatus, ...] = (S.RUNNING, S.PAUSING, S.CANCELLING)  # a controller actor is running it


def allowed(source: JobStatus | str, target: JobStatus | str) -> bool:
    return JobStatus(target) in TRANSITIONS[JobStatus(source)]


def check_moves(sources: tuple[JobStatus, ...], target: JobStatus) -> None:
    """Raise if a caller asks for a move the table does not list (a programming error, not a request's)."""
    bad = [s for s in sources if not allowed(s, target)]
    if bad:
        raise ValueError(f"job status moves {[f'{s}->{target}' for s in bad]} are not in TRANSITIONS")
