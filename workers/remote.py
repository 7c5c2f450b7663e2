"""Waiting for calls on Ray worker actors: bounded, and a failure names the group, rank and method.

A rank whose collective timed out waited for a peer: the ranks blocked in the same collective fail
with it, while the peer they waited for, hung, neither answers nor fails. So such a failure waits
HUNG_GRACE_S for the other ranks and names any that stay silent as hung, not the rank that raised.
"""

from __future__ import annotations

import time
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

HUNG_GRACE_S = 5.0  # the ranks blocked in one collective time out within moments of each other


class WorkerGroupError(RuntimeError):
    """A worker-group call failed; `kind` "raised", "died", "hung" or "timeout" (job recovery retries
    all but the first)."""

    def __init__(self, group: str, method: str, rank: int | None, message: str, kind: str = "raised") -> None:
        where = f"rank {rank}" if rank is not None else "ranks"
        super().__init__(f"worker group '{group}', {where}, method '{method}': {message}")
        self.group, self.method, self.rank, self.kind = group, method, rank, kind


def wait_all(
    group: str,
    method: str,
    refs: list[ray.ObjectRef],
    timeout_s: float,
    hosts: list[str] | None = None,
    ranks: list[int] | None = None,
) -> list[Any]:
    """Results in the refs' order; the first failing rank raises at once (a collective's timeout after
    HUNG_GRACE_S), nothing waits past the timeout. `hosts`: where each rank of the group runs, for the
    errors; `ranks`: the group's rank of each ref when they are not all of its ranks in order (a call
    on one worker of the group is named by that worker's rank, pid and node)."""
    named = list(range(len(refs))) if ranks is None else list(ranks)
    pending = {ref: i for i, ref in enumerate(refs)}
    results: list[Any] = [None] * len(refs)
    deadline = time.monotonic() + timeout_s
    while pending:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            silent = sorted(named[i] for i in pending.values())
            raise WorkerGroupError(
                group,
                method,
                silent[0],
                f"did not answer within {timeout_s:g}s{_where(silent, hosts)}",
                kind="timeout",
            )
        ready, _ = ray.wait(list(pending), num_returns=1, timeout=min(remaining, 5.0))
        for ref in ready:
            i = pending.pop(ref)
            rank = named[i]
            try:
                results[i] = ray.get(ref, timeout=max(deadline - time.monotonic(), 0.1))
            except RayTaskError as err:
                cause = err.cause if getattr(err, "cause", None) is not None else err
                if pending and _collective_timed_out(cause):
                    silent = {r: named[j] for r, j in pending.items()}
                    _raise_hung(group, method, rank, silent, hosts, cause)
                raise WorkerGroupError(
                    group, method, rank, f"raised {type(cause).__name__}: {cause}"
                ) from err
            except RayActorError as err:
                raise WorkerGroupError(
                    group, method, rank, f"the worker actor died{_where([rank], hosts)}: {err}", kind="died"
                ) from err
            except GetTimeoutError as err:
                raise WorkerGroupError(
                    group, method, rank, f"did not answer in time{_where([rank], hosts)}", kind="timeout"
                ) from err
    return results


def _collective_timed_out(cause: BaseException) -> bool:
    """gloo's words for a collective of the group that waited past its timeout (an error that names
    its worker itself, a weight transfer's, is not the group's)."""
    named = getattr(cause, "names_its_worker", False)
    return isinstance(cause, RuntimeError) and not named and "Timed out waiting" in str(cause)


def _raise_hung(
    group: str,
    method: str,
    rank: int,
    pending: dict[ray.ObjectRef, int],
    hosts: list[str] | None,
    cause: BaseException,
) -> None:
    """Raise naming the ranks still silent HUNG_GRACE_S after `rank`'s collective timed out, if any."""
    _, silent = ray.wait(list(pending), num_returns=len(pending), timeout=HUNG_GRACE_S)
    hung = sorted(pending[ref] for ref in silent)
    if not hung:
        return
    raise WorkerGroupError(
        group,
        method,
        hung[0],
        f"hung{_where(hung, hosts)}: neither answered nor failed within {HUNG_GRACE_S:.0f}s of rank {rank}'s "
        f"collective timing out waiting for it (rank {rank} raised {type(cause).__name__}: {cause})",
        kind="hung",
    )


def _where(silent: list[int], hosts: list[str] | None) -> str:
    """' (pid 123 on 10.0.0.2)' for the first silent rank, and the others' ranks when there are more."""
    where = f" ({hosts[silent[0]]})" if hosts else ""
    return where + (f" (ranks {silent} are silent)" if len(silent) > 1 else "")
