"""The Tinker API's futures: work answers at once with a request id the SDK polls (`retrieve_future`).
A future holds its owner's JSON answer, protobuf bytes (forward_backward, sample) or a failure in the
SDK's `{"error", "category"}` shape. Dispatcher threads resolve them and the event loop reads them."""

from __future__ import annotations

import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

KEEP_S = 3600.0  # how long a finished future stays readable


@dataclass
class Future:
    id: str
    owner: str
    kind: str
    created: float = field(default_factory=time.time)
    done_at: float | None = None
    answer: dict[str, Any] | bytes | None = None
    cancelled: bool = False

    @property
    def done(self) -> bool:
        return self.done_at is not None


class FutureTable:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._futures: dict[str, Future] = {}

    def create(self, owner: str, kind: str) -> Future:
        future = Future(f"req-{uuid.uuid4().hex[:16]}", owner, kind)
        with self._lock:
            cutoff = time.time() - KEEP_S
            for key in [k for k, f in self._futures.items() if f.done_at is not None and f.done_at < cutoff]:
                del self._futures[key]
            self._futures[future.id] = future
        return future

    def get(self, request_id: str, owner: str | None) -> Future | None:
        """The future, if it exists and `owner` may see it (None: the admin, every owner's)."""
        with self._lock:
            future = self._futures.get(request_id)
        return future if future is not None and owner in (None, future.owner) else None

    def finish(self, future: Future, answer: dict[str, Any] | bytes) -> None:
        with self._lock:
            if not future.done:  # cancelled first: the late result is dropped
                future.answer, future.done_at = answer, time.time()

    def fail(self, future: Future, message: str, category: str = "server") -> None:
        self.finish(future, {"error": message, "category": category})

    def cancel(self, future: Future) -> bool:
        """Marks a pending future cancelled (its queued work is skipped); False if it had finished."""
        with self._lock:
            if future.done:
                return False
            future.cancelled, future.done_at = True, time.time()
            future.answer = {"error": "cancelled by the client", "category": "user"}
            return True
