"""Waiting for calls on Ray worker actors: bounded, and a failure names the group, rank and method."""

from __future__ import annotations

import time
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError


class WorkerGroupError(RuntimeError):
    """A worker-group call failed; `kind` "raised", "died" or "timeout" (job recovery retries the last two)."""

    def __init__(self, group: str, method: str, rank: int | None, message: str, kind: str = "raised") -> None:
        where = f"rank {rank}" if rank is not None else "ranks"
        super().__init__(f"worker group '{group}', {where}, method '{method}': {message}")
        self.group, self.method, self.rank, self.kind = group, method, rank, kind


def wait_all(group: str, method: str, refs: list[ray.ObjectRef], timeout_s: float) -> list[Any]:
    """Results in rank order; the first failing rank raises at once, nothing waits past the timeout."""
    pending = {ref: rank for rank, ref in enumerate(refs)}
    results: list[Any] = [None] * len(refs)
    deadline = time.monotonic() + timeout_s
    while pending:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise WorkerGroupError(
                group,
                method,
                None,
                f"ranks {sorted(pending.values())} did not answer within {timeout_s:.0f}s",
                kind="timeout",
            )
        ready, _ = ray.wait(list(pending), num_returns=1, timeout=min(remaining, 5.0))
        for ref in ready:
            rank = pending.pop(ref)
            try:
                results[rank] = ray.get(ref, timeout=max(deadline - time.monotonic(), 0.1))
            except RayTaskError as err:
                cause = err.cause if getattr(err, "cause", None) is not None else err
                raise WorkerGroupError(
                    group, method, rank, f"raised {type(cause).__name__}: {cause}"
                ) from err
            except RayActorError as err:
                raise WorkerGroupError(
                    group, method, rank, f"the worker actor died ({err})", kind="died"
                ) from err
            except GetTimeoutError as err:
                raise WorkerGroupError(group, method, rank, "did not answer in time", kind="timeout") from err
    return results
