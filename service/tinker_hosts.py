"""One SessionHost Ray actor per served base model, and the dispatcher that feeds it.

The API process never imports torch: `HostActor` below is the torch-free shim that Ray runs as the
actor's body; only inside that process does it build a built-in model's folder
(engines/tiny_models.py) and import `workers.session_host.SessionHost` (docs/ARCHITECTURE.md, "Tinker
API"). Its process is set up as a job's ranks are (engines/host_memory.py): malloc keeps freed
memory and asks for transparent huge pages, which took a SmolLM2 session's forward_backward +
optim_step from ~700k minor page faults to 1-5k and to 0.86x the time (bench/session_malloc.py).
A host is started lazily, by the first request that needs its base model, so serving many
base models costs nothing until they are used; while it runs, the scheduler counts its CPUs as held
(`accounts`: `Scheduler.hold`), so jobs are scheduled around it.

Each host has one dispatcher thread. Requests are queued per queue key (a training model id or a
sampler id) under their owner; the dispatcher builds each `run_batch` call by taking the head op of
one queue after another, round-robin between owners and, within an owner, between its queues, at
most one op per queue per batch (a session's ops run in the order it sent them). One batch is in
flight per host; its `ray.get` has a timeout, and a timeout or a dead actor fails the batch's
futures with a message that names the host.
"""

from __future__ import annotations

import importlib
import logging
import os
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray

from engines.host_memory import keep_freed_memory, malloc_tunables
from service.tinker_futures import Future, FutureTable

log = logging.getLogger("tandem.tinker")

# (ok result) -> (json result, protobuf result): what the future answers
Finish = Callable[[dict[str, Any]], tuple[dict[str, Any] | None, bytes | None]]


class HostActor:
    """The body of a SessionHost actor (runs in its own process, where torch may be imported)."""

    def __init__(self, base_model: str, workdir: str, options: dict[str, Any]) -> None:
        from engines.tiny_models import BUILTIN_MODELS, build_builtin_model

        self.keeps_freed_memory = keep_freed_memory()  # this process is the host's alone

        if base_model in BUILTIN_MODELS:
            model_path = str(build_builtin_model(base_model, Path(workdir) / "models"))
        else:
            model_path = base_model
        module = importlib.import_module("workers.session_host")
        self.host = module.SessionHost(base_model, model_path, workdir, options)

    def describe(self) -> dict[str, Any]:
        malloc = {
            "keeps_freed_memory": self.keeps_freed_memory,
            "tunables": os.environ.get("GLIBC_TUNABLES", ""),
        }
        return {**self.host.describe(), "malloc": malloc}

    def run_batch(self, ops: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return self.host.run_batch(ops)


@dataclass
class Op:
    future: Future
    owner: str
    queue: str  # the model id or sampler id whose order it keeps
    body: dict[str, Any]
    finish: Finish
    on_ok: Callable[[dict[str, Any]], None] | None = None  # bookkeeping after success (store rows)
    on_fail: Callable[[], None] | None = None  # undo after a failure (a refused create stores nothing)


@dataclass
class HostOptions:
    max_rank: int = 64
    max_batch: int = 16
    batch_timeout_s: float = 600.0
    start_timeout_s: float = 600.0
    cpus: float = 1.0
    extra: dict[str, Any] = field(default_factory=dict)


class Host:
    """One base model's actor and dispatcher."""

    def __init__(self, base_model: str, workdir: Path, futures: FutureTable, options: HostOptions,
                 runtime_env: dict | None = None, on_lost: Callable[[Host], None] | None = None,
                 accounts: Any = None) -> None:  # fmt: skip
        self.base_model, self.workdir, self.futures, self.options = base_model, workdir, futures, options
        self.runtime_env, self.on_lost, self.accounts = runtime_env, on_lost, accounts
        self.restarts = 0
        self.name = f"session host '{base_model}'"
        self._cond = threading.Condition()
        self._queues: OrderedDict[str, OrderedDict[str, deque[Op]]] = OrderedDict()  # owner -> key -> ops
        self._thread: threading.Thread | None = None
        self._stop = False
        self.actor: Any = None
        self.info: dict[str, Any] | None = None
        self.error: str | None = None
        self.batches = 0

    # ---- requests ---------------------------------------------------------------------------------

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
        if self.actor is not None:
            ray.kill(self.actor)
        self._release()

    def _release(self) -> None:
        if self.accounts is not None:
            self.accounts.release(self.name)

    def queued(self) -> int:
        with self._cond:
            return sum(len(q) for keys in self._queues.values() for q in keys.values())

    # ---- the dispatcher ---------------------------------------------------------------------------

    def _next_batch(self) -> list[Op]:
        """Up to max_batch ops, round-robin between owners, then between each owner's queues."""
        batch: list[Op] = []
        taken: set[str] = set()
        progress = True
        while progress and len(batch) < self.options.max_batch:
            progress = False
            for owner in list(self._queues):
                keys = self._queues[owner]
                for key in list(keys):
                    while keys[key] and keys[key][0].future.cancelled:  # cancelled: dropped, not a turn
                        keys[key].popleft()
                    if not keys[key]:
                        del keys[key]
                        continue
                    if key in taken:
                        continue
                    batch.append(keys[key].popleft())
                    if not keys[key]:
                        del keys[key]
                    else:
                        keys.move_to_end(key)  # the owner's next queue goes first next time
                    taken.add(key)
                    progress = True
                    break
                if not keys:
                    del self._queues[owner]
                else:
                    self._queues.move_to_end(owner)
                if len(batch) >= self.options.max_batch:
                    break
        return batch

    def _start_actor(self) -> None:
        from engines.tiny_models import BUILTIN_MODELS  # torch-free: names only

        if self.base_model not in BUILTIN_MODELS and not Path(self.base_model, "config.json").is_file():
            raise FileNotFoundError(f"{self.base_model} is neither a built-in model nor a model folder")
        if not ray.is_initialized():  # ray.remote would start a private cluster in the API process
            raise RuntimeError("Ray is not running in this service (a service started without a cluster)")
        # glibc reads GLIBC_TUNABLES when the process starts: it goes in the actor's environment (Ray
        # merges its env_vars into the job's).
        env = dict(self.runtime_env or {})
        env["env_vars"] = {
            **env.get("env_vars", {}),
            "GLIBC_TUNABLES": malloc_tunables(os.environ.get("GLIBC_TUNABLES")),
        }
        opts: dict[str, Any] = {"num_cpus": self.options.cpus, "max_concurrency": 1, "runtime_env": env}
        options = {"max_rank": self.options.max_rank, **self.options.extra}
        self.workdir.mkdir(parents=True, exist_ok=True)
        if self.accounts is not None:
            self.accounts.hold(self.name, self.options.cpus)
        self.actor = ray.remote(HostActor).options(**opts).remote(self.base_model, str(self.workdir), options)
        self.info = ray.get(self.actor.describe.remote(), timeout=self.options.start_timeout_s)
        log.info("%s is up: %s", self.name, self.info)

    def _start(self) -> None:
        try:
            self._start_actor()
        except Exception as err:  # noqa: BLE001 - every queued and later op is told why
            self.error = f"{self.name} failed to start: {type(err).__name__}: {err}"[:2000]
            log.error(self.error)
            self._release()

    def _run(self) -> None:
        self._start()
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
        if self.actor is None and self.error is None:  # the last one died: a fresh host for this batch
            self.restarts += 1
            self._start()
        if self.error is not None:
            for op in batch:
                self._settle(op, {"error": {"category": "server", "field": None, "message": self.error}})
            return
        started = time.monotonic()
        try:
            results = ray.get(self.actor.run_batch.remote([op.body for op in batch]),
                              timeout=self.options.batch_timeout_s)  # fmt: skip
        except ray.exceptions.GetTimeoutError:
            message = f"{self.name} did not answer run_batch within {self.options.batch_timeout_s:g} s"
            results = [{"error": {"category": "server", "field": None, "message": message}}] * len(batch)
        except Exception as err:  # noqa: BLE001 - a dead actor: every op of the batch is told
            message = f"{self.name} failed: {type(err).__name__}: {err}"[:2000]
            results = [{"error": {"category": "server", "field": None, "message": message}}] * len(batch)
            if isinstance(err, ray.exceptions.RayActorError):
                self._lost(message)
        self.batches += 1
        log.debug("%s ran %d ops in %.3f s", self.name, len(batch), time.monotonic() - started)
        for op, result in zip(batch, results, strict=False):
            self._settle(op, result)

    def _lost(self, why: str) -> None:
        """The actor died: forget it (the next batch starts another) and tell the service."""
        log.error("%s died; a new one starts with the next request: %s", self.name, why)
        self.actor, self.info = None, None
        self._release()
        if self.on_lost is not None:
            self.on_lost(self)

    def _settle(self, op: Op, result: dict[str, Any]) -> None:
        if "ok" not in result:
            err = result.get("error") or {}
            where = (
                f"{err['field']}: "
                if err.get("field") and err["field"] not in str(err.get("message"))
                else ""
            )
            if op.on_fail is not None:
                op.on_fail()
            self.futures.fail(
                op.future, where + str(err.get("message", "failed")), err.get("category", "server")
            )
            return
        try:
            if op.on_ok is not None:
                op.on_ok(result["ok"])
            json_body, proto = op.finish(result["ok"])
        except Exception as err:  # noqa: BLE001 - a result the API cannot read fails that op only
            log.exception("%s: reading the result of %s", self.name, op.body.get("op"))
            self.futures.fail(op.future, f"{self.name}: unreadable result of {op.body.get('op')}: {err}")
            return
        self.futures.finish(op.future, json_body, proto)
