"""What the hot read routes computed, kept until the store's next write to its topic
(`JobStore.changes`): dashboards poll far more often than a job writes.

Requests that miss together share one read (a write during it leaves the entry stale on arrival).
Values are treated as immutable; entries are bounded in number and bytes, least recently used first out.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Any

from starlette.concurrency import run_in_threadpool

from service.store import JobStore

MISSING = object()  # peek's answer when nothing valid is cached


class ReadCache:
    def __init__(self, store: JobStore, max_entries: int = 256, max_bytes: int = 64 << 20) -> None:
        self.store = store
        self.max_entries, self.max_bytes = max_entries, max_bytes
        # key -> (changes of its topic when it was read, value, size in bytes)
        self._entries: OrderedDict[Hashable, tuple[int, Any, int]] = OrderedDict()
        self._bytes = 0
        self._reading: dict[tuple[Hashable, int], asyncio.Task] = {}
        self.reads = 0  # reads made (misses), for benchmarks

    def peek(self, key: Hashable, topic: str) -> Any:
        """The value cached under `key` while `topic` is unchanged since it was read, else MISSING."""
        entry = self._entries.get(key)
        if entry is None or entry[0] != self.store.changes(topic):
            return MISSING
        self._entries.move_to_end(key)
        return entry[1]

    async def get(self, key: Hashable, topic: str, read: Callable[[], Any]) -> Any:
        """The value cached under `key` while `topic`'s rows are unchanged, else `read()`'s (in a thread)."""
        value = self.peek(key, topic)
        if value is not MISSING:
            return value
        version = self.store.changes(topic)
        task = self._reading.get((key, version))
        if task is None:
            task = asyncio.ensure_future(self._read(key, version, read))
            task.add_done_callback(_retrieve)
            self._reading[(key, version)] = task
        # shielded: a client that goes away does not cancel the read the others wait for
        return await asyncio.shield(task)

    async def _read(self, key: Hashable, version: int, read: Callable[[], Any]) -> Any:
        self.reads += 1
        try:
            value = await run_in_threadpool(read)
        finally:
            del self._reading[(key, version)]
        self._put(key, version, value)
        return value

    def _put(self, key: Hashable, version: int, value: Any) -> None:
        size = len(value) if isinstance(value, bytes) else 0
        if size > self.max_bytes // 4:
            return  # one huge page would push out everything else
        old = self._entries.pop(key, None)
        if old is not None:
            self._bytes -= old[2]
        self._entries[key] = (version, value, size)
        self._bytes += size
        while len(self._entries) > self.max_entries or self._bytes > self.max_bytes:
            _, (_, _, dropped) = self._entries.popitem(last=False)
            self._bytes -= dropped


def _retrieve(task: asyncio.Task) -> None:
    """A read whose every requester went away: its error is theirs, not an unretrieved one."""
    if not task.cancelled():
        task.exception()
