"""The Tinker API's futures: work answers at once with a request id that the SDK polls
(`/api/v1/retrieve_future`). A future is its owner's alone and holds its JSON result, its protobuf result
(forward_backward, sample) or a failure in the SDK's `{"error", "category"}` shape; dispatcher threads
resolve them and the event loop reads them, so a lock guards the table. Finished ones go after `KEEP_S`.
"""

from __future__ import annotations

import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

KEEP_S = 3600.0


@dataclass
class Future:
    id: str
    owner: str
    kind: str
    created: float = field(default_factory=time.time)
    done_at: float | None = None
    json: dict[str, Any] | None = None
    proto: bytes | None = None
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
            self._drop_old()
            self._futures[future.id] = future
        return future

    def get(self, request_id: str, owner: str | None) -> Future | None:
        """The future, if it exists and `owner` may see it (None: the admin, every owner's)."""
        with self._lock:
            future = self._futures.get(request_id)
        if future is None or (owner is not None and future.owner != owner):
            return None
        return future

    def finish(self, future: Future, json: dict[str, Any] | None = None, proto: bytes | None = None) -> None:
        with self._lock:
            if future.done:  # cancelled first: the late result is dropped
                return
            future.json, future.proto, future.done_at = json, proto, time.time()

    def fail(self, future: Future, message: str, category: str = "server") -> None:
        self.finish(future, {"error": message, "category": category})

    def cancel(self, future: Future) -> bool:
        """Marks a pending future cancelled (its queued work is skipped); False if it had finished."""
        with self._lock:
            if future.done:
                return False
            future.cancelled = True
            future.json, future.done_at = (
                {"error": "cancelled by the client", "category": "user"},
                time.time(),
            )
            return True

    def _drop_old(self) -> None:
        cutoff = time.time() - KEEP_S
        for key in [k for k, f in self._futures.items() if f.done_at is not None and f.done_at < cutoff]:
            del self._futures[key]
