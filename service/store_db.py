"""The store's SQLite file (WAL, owner-only): one connection per thread, and writes that count what
they changed.

`changes(topic)` counts the committed writes that changed a topic's rows (a table, or one job's metric
series). The service is its home's only writer, so an unchanged count means unchanged rows: the API's
read cache relies on it.
"""

from __future__ import annotations

import os
import sqlite3
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any


class StoreDb:
    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._local = threading.local()
        self._write_lock = threading.Lock()
        self._changes: dict[str, int] = {}  # topic -> committed writes that changed it (api/read_cache.py)
        _create_private(self.path)

    def _db(self) -> sqlite3.Connection:
        conn = getattr(self._local, "conn", None)
        if conn is None:
            conn = sqlite3.connect(self.path, timeout=30, isolation_level=None, check_same_thread=False)
            conn.row_factory = sqlite3.Row
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("PRAGMA synchronous=NORMAL")
            conn.execute("PRAGMA foreign_keys=ON")
            self._local.conn = conn
        return conn

    def _rows(self, sql: str, args: tuple | list = ()) -> list[sqlite3.Row]:
        return self._db().execute(sql, args).fetchall()

    def _first(self, sql: str, args: tuple | list = ()) -> sqlite3.Row | None:
        return self._db().execute(sql, args).fetchone()

    def _write(self, sql: str, args: tuple | list, topic: str = "jobs") -> int:
        """One write statement under `topic`; the number of rows it changed."""
        with self._tx(topic) as db:
            return db.execute(sql, args).rowcount

    def _insert(self, table: str, columns: str, *rows: tuple[Any, ...], verb: str = "INSERT") -> int:
        """Add `rows` (values of the comma-separated `columns`) to `table`, under its topic; the id of a
        single row."""
        if not rows:
            return 0
        sql = f"{verb} INTO {table} ({columns}) VALUES ({','.join('?' * len(rows[0]))})"
        with self._tx(table) as db:
            if len(rows) == 1:
                return int(db.execute(sql, rows[0]).lastrowid)
            db.executemany(sql, rows)
            return 0

    def changes(self, topic: str) -> int:
        """How many committed writes changed `topic`'s rows so far (a table name, or `metrics_topic`)."""
        return self._changes.get(topic, 0)

    @contextmanager
    def _tx(self, *topics: str) -> Iterator[sqlite3.Connection]:
        """A write transaction over `topics`: every topic whose rows it may change must be named."""
        if not topics:
            raise TypeError("a write names the topics it changes: readers' caches depend on them")
        db = self._db()
        with self._write_lock:
            before = db.total_changes
            db.execute("BEGIN IMMEDIATE")
            try:
                yield db
                db.execute("COMMIT")
            except BaseException:
                db.execute("ROLLBACK")
                raise
            # after the commit, never before: a reader that sees the new count reads the new rows
            if db.total_changes != before:
                for topic in topics:
                    self._changes[topic] = self._changes.get(topic, 0) + 1


def _create_private(path: Path) -> None:
    """Token hashes and every job's data: 0600 (SQLite gives its -wal and -shm files the same mode)."""
    os.close(os.open(path, os.O_CREAT | os.O_RDWR, 0o600))
    os.chmod(path, 0o600)
