"""Warm controllers: a record's controller actor started, its runner's imports done, before a record
needs it. A controller serves one record and ends with it: nothing of one job's process is reused.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import ray

from service.workloads import WorkloadActor

log = logging.getLogger("tandem.scheduler")


class ControllerPool:
    def __init__(self, runner: str, size: int, options: dict[str, Any]) -> None:
        """`runner`: the workload's "module:Class"; `options`: the actor's Ray options."""
        if size < 0:
            raise ValueError(f"warm controllers must be >= 0, got {size}")
        self.runner, self.size, self.options = runner, size, options
        self._spares: list[tuple[Any, ray.ObjectRef]] = []  # (actor, its pid: ready once imported)
        self._lock = threading.Lock()
        self._closed = False

    def _new(self) -> Any:
        return ray.remote(WorkloadActor).options(**self.options).remote(self.runner)

    def fill(self) -> None:
        """Start spares up to `size` (they import in their own processes; nothing waits here)."""
        with self._lock:
            while not self._closed and len(self._spares) < self.size:
                actor = self._new()
                self._spares.append((actor, actor.pid.remote()))

    def take(self) -> Any:
        """A spare controller, or a new one when there is none (`fill` starts the next spares). A spare
        that failed to start is dropped; one still importing is taken (it is ahead of a new one)."""
        with self._lock:
            actor = None
            while self._spares and actor is None:
                actor, ready = self._spares.pop(0)
                if ray.wait([ready], timeout=0)[0]:
                    try:
                        ray.get(ready, timeout=5)
                    except Exception as err:
                        log.warning("a warm controller failed to start (%s): taking another", err)
                        ray.kill(actor, no_restart=True)
                        actor = None
            if actor is None:
                actor = self._new()
        return actor

    def spares(self) -> list[Any]:
        """The spare controllers (importing, or waiting for a record), oldest first."""
        with self._lock:
            return [actor for actor, _ in self._spares]

    def close(self) -> None:
        with self._lock:
            self._closed = True
            spares, self._spares = self._spares, []
        for actor, _ in spares:
            ray.kill(actor, no_restart=True)
