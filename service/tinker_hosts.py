"""One session-host worker group (workers/session_host.py) per served base model, and its dispatcher.

The dispatcher takes batches round-robin between owners, then between an owner's queues (a model or
sampler id), one op per queue per batch: a session's ops keep their order and a batch's ops commute, so
its forwards and samples each go in one call of the host's batched form, the rest one call each.
"""

from __future__ import annotations

import logging
import threading
import uuid
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray

from controller.resource_pool import ResourcePool
from controller.worker_group import RayWorkerGroup, WorkerGroupError
from engines.models.tiny_models import BUILTIN_MODELS
from service.tinker_sessions import Future, FutureTable
from workers.session_host import Result, SessionWorker, error

log = logging.getLogger("tandem.tinker")
# the host's batched operations: each takes a list of calls' keyword arguments
BATCHED = (SessionWorker.forward_backward_calls, SessionWorker.sample)

# What a future answers: JSON, protobuf bytes, or either made from the host's ok result (after the
# bookkeeping of its success: store rows).
Answer = dict[str, Any] | bytes
Finish = Answer | Callable[[Any], Answer]


@dataclass
class Op:
    """One SessionWorker operation and its arguments (a batched one's: one item of its list)."""

    future: Future
    owner: str
    queue: str  # the model id or sampler id whose order it keeps
    operation: Callable[..., Any]  # a registered method of SessionWorker
    kwargs: dict[str, Any]
    finish: Finish
    on_fail: Callable[[], None] | None = None  # undo after a failure (a refused create stores nothing)


@dataclass
class HostOptions:
    max_rank: int = 64
    max_batch: int = 16
    max_pending: int | None = 256  # an owner's ops queued or running at once (each holds its request)
    batch_timeout_s: float = 600.0
    start_timeout_s: float = 600.0
    cpus: float = 1.0


class Host:
    """One base model's actor and dispatcher; while it runs, the scheduler (`accounts`) counts its CPUs.
    It starts with its first batch; one that dies or fails to start fails its batch, and the next starts it
    again (a model folder copied in late, a cluster that was full)."""

    def __init__(self, base_model: str, workdir: Path, futures: FutureTable, options: HostOptions,
                 on_lost: Callable[[Host], None] | None = None, accounts: Any = None) -> None:  # fmt: skip
        self.base_model, self.workdir, self.futures, self.options = base_model, workdir, futures, options
        self.on_lost, self.accounts = on_lost, accounts
        self.restarts, self.started = 0, False
        self.name = f"session host '{base_model}'"
        self._cond = threading.Condition()
        self._queues: OrderedDict[str, OrderedDict[str, deque[Op]]] = OrderedDict()  # owner -> key -> ops
        self._thread: threading.Thread | None = None
        self._stop = False
        self.group: RayWorkerGroup | None = None
        self.pool: ResourcePool | None = None
        self.info: dict[str, Any] | None = None
        self.error: str | None = None

    def submit(self, op: Op) -> None:
        with self._cond:
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name=f"tinker-{self.base_model}", daemon=True
                )
                self._thread.start()
            self._queues.setdefault(op.owner, OrderedDict()).setdefault(op.queue, deque()).append(op)
            self._cond.notify_all()

    def stop(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        self._release()

    def _release(self) -> None:
        group, pool, self.group, self.pool, self.info = self.group, self.pool, None, None, None
        if group is not None:
            group.shutdown()
        if pool is not None:
            pool.remove()
        if self.accounts is not None:
            self.accounts.release(self.name)

    def _next_batch(self) -> list[Op]:
        """Up to max_batch ops, round-robin between owners, then between each owner's queues."""
        batch: list[Op] = []
        taken: set[str] = set()  # the queues with an op in the batch
        while len(batch) < self.options.max_batch:
            size = len(batch)
            for owner, queues in list(self._queues.items()):
                for key in [k for k, ops in queues.items() if not _live(ops, self.futures.release)]:
                    del queues[key]
                key = next((k for k in queues if k not in taken), None)
                if key is not None:
                    batch.append(queues[key].popleft())
                    taken.add(key)
                    queues.move_to_end(key)  # the owner's next queue goes first next time
                if any(queues.values()):
                    self._queues.move_to_end(owner)
                else:
                    del self._queues[owner]
                if len(batch) >= self.options.max_batch:
                    break
            if len(batch) == size:
                break
        return batch

    def _start(self) -> None:
        self.error = None
        try:
            if self.base_model not in BUILTIN_MODELS and not Path(self.base_model, "config.json").is_file():
                raise FileNotFoundError(f"{self.base_model} is neither a built-in model nor a model folder")
            if not ray.is_initialized():  # ray.remote would start a private cluster in the API process
                raise RuntimeError("Ray is not running in this service (a service started without a cluster)")
            options = {"max_rank": self.options.max_rank}
            self.workdir.mkdir(parents=True, exist_ok=True)
            if self.accounts is not None:
                self.accounts.hold(self.name, self.options.cpus)
            timeout = self.options.start_timeout_s
            # unique per start: a group left by a service that died still holds its name in the cluster
            name = f"session-host {self.base_model} {uuid.uuid4().hex[:8]}"
            self.pool = ResourcePool(
                1, self.options.cpus, gpus_per_bundle=0.0, name=name, ready_timeout_s=timeout
            )
            self.group = RayWorkerGroup(self.pool, SessionWorker, self.base_model, str(self.workdir), options,
                                        group_name=self.name, call_timeout_s=self.options.batch_timeout_s,
                                        start_timeout_s=timeout)  # fmt: skip
            self.info = self.group.describe()
            log.info("%s is up: %s", self.name, self.info)
        except Exception as err:  # noqa: BLE001 - every queued and later op is told why
            self.error = f"{self.name} failed to start: {type(err).__name__}: {err}"[:2000]
            log.error(self.error)
            self._release()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._stop and not self._queues:
                    self._cond.wait(1.0)
                if self._stop:
                    return
                batch = self._next_batch()
            if batch:
                self._dispatch(batch)

    def _dispatch(self, batch: list[Op]) -> None:
        if self.group is None:  # not started yet, or the last one died or failed to start: a fresh one
            self.restarts += self.started
            self.started = True
            self._start()
        batched = [[op for op in batch if op.operation is kind] for kind in BATCHED]
        singles = [[op] for op in batch if op.operation not in BATCHED]
        for ops in [ops for ops in batched if ops] + singles:
            for op, result in zip(ops, self._call(ops), strict=True):
                self._settle(op, result)

    def _call(self, ops: list[Op]) -> list[Result]:
        """One group call for `ops` (all of one batched operation, or a single op): a result each."""
        if self.error is not None or self.group is None:
            return [error("server", None, self.error or f"{self.name} is not running")] * len(ops)
        method = getattr(self.group, ops[0].operation.__name__)
        try:
            if ops[0].operation in BATCHED:
                return method([op.kwargs for op in ops])
            answer = method(**ops[0].kwargs)
            return [answer[0] if isinstance(answer, list) else answer]  # ONE_TO_ALL: one rank's
        except WorkerGroupError as err:  # a dead worker or a timeout: every op of the call is told
            message = f"{self.name} failed: {err}"[:2000]
            if err.kind == "died":
                self._lost(message)
            return [error("server", None, message)] * len(ops)

    def _lost(self, why: str) -> None:
        log.error("%s died; a new one starts with the next request: %s", self.name, why)
        self._release()
        if self.on_lost is not None:
            self.on_lost(self)

    def _settle(self, op: Op, result: Result) -> None:
        if "ok" not in result:
            err = result.get("error") or {}
            message, field = str(err.get("message", "failed")), err.get("field")
            if field and field not in message:
                message = f"{field}: {message}"
            if op.on_fail is not None:
                op.on_fail()
            self.futures.fail(op.future, message, err.get("category", "server"))
            return
        try:
            answer = op.finish(result["ok"]) if callable(op.finish) else op.finish
        except Exception as err:  # noqa: BLE001 - a result the API cannot read fails that op only
            name = op.operation.__name__
            log.exception("%s: reading the result of %s", self.name, name)
            self.futures.fail(op.future, f"{self.name}: unreadable result of {name}: {err}")
            return
        self.futures.finish(op.future, answer)


def _live(ops: deque[Op], release: Callable[[Future], None]) -> bool:
    """Whether a queue holds an op once its cancelled ones at the head are dropped (they get no turn)."""
    while ops and ops[0].future.cancelled:
        release(ops.popleft().future)
    return bool(ops)
