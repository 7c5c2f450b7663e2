"""A worker that reports the OpenMP wait settings its rank found in its environment, for the tests
of engines/threads.openmp_wait_env as controller/worker_group.py applies it."""

from __future__ import annotations

import os

from engines.threads import OPENMP_WAIT_VARS
from workers.base import Dispatch, Worker, register


class WaitWorker(Worker):
    @register(Dispatch.ONE_TO_ALL)
    def wait_env(self) -> dict[str, str | None]:
        return {name: os.environ.get(name) for name in OPENMP_WAIT_VARS}
