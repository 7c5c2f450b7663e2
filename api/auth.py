"""API keys: who a request is (its key's owner) and what it may do (scopes), checked in constant time.

A key is sent as `Authorization: Bearer <key>` or `X-API-Key: <key>` (the tinker SDK's). Keys are 32
random bytes, so a plain SHA-256 hash is enough at rest; they start with `tml-`, the only prefix the
tinker SDK accepts. The first start writes the admin token to `$TANDEM_HOME/admin_token` (mode 600),
unless TANDEM_ADMIN_TOKEN is set; a start with another admin token revokes the one it replaces.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastapi import Request
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import Headers

from api.errors import APIError
from api.read_cache import MISSING, ReadCache
from service.keys import ADMIN_OWNER
from service.store import JobStore

SCOPES = ("read", "write")
CHALLENGE = {"WWW-Authenticate": 'Bearer realm="tandem"'}
KEY_PREFIX = "tml-"
ADMIN_NAMES = ("admin", "admin (TANDEM_ADMIN_TOKEN)")  # the names ensure_admin_token registers
TOUCH_EVERY_S = 60.0  # last_used_at is written at most this often per key


@dataclass(frozen=True)
class Caller:
    """Who sent a request: its key's id and owner, scopes, and whether it is the admin's."""

    key_id: str
    owner: str
    scopes: tuple[str, ...]
    admin: bool

    @property
    def sees(self) -> str | None:
        """The owner whose work this caller sees; None for an admin (everyone's)."""
        return None if self.admin else self.owner

    def viewing(self, owner: str | None) -> str | None:
        """The owner filter of a read: an admin's `?owner=`, anyone else's own name."""
        return owner if self.admin else self.owner


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def new_key() -> str:
    return KEY_PREFIX + secrets.token_urlsafe(32)


def ensure_admin_token(store: JobStore, home: Path) -> Path:
    """Register the admin token once, and revoke the admin tokens it replaces (the API cannot revoke
    one: a new TANDEM_ADMIN_TOKEN, or a deleted file, is how a leaked one is rotated); returns the file."""
    path = home / "admin_token"
    given = os.environ.get("TANDEM_ADMIN_TOKEN")
    tokens = {t["hash"]: t for t in store.tokens()}
    if given:
        token, known = given, tokens.get(hash_token(given))
        if known is None:
            store.add_token(ADMIN_NAMES[1], hash_token(given), list(SCOPES), ADMIN_OWNER, True)
        elif known["revoked_at"] is not None:
            raise ValueError("TANDEM_ADMIN_TOKEN: this admin token was revoked when another replaced it; "
                             "set a new one (e.g. tml- and 43 random URL-safe characters)")  # fmt: skip
    elif path.exists() and _active(tokens.get(hash_token(path.read_text().strip()))):
        token = path.read_text().strip()
    else:
        token = _write_admin_token(store, path)
    for old in tokens.values():
        if old["name"] in ADMIN_NAMES and old["hash"] != hash_token(token) and old["revoked_at"] is None:
            store.revoke_key(old["id"])
    return path


def _active(record: dict[str, Any] | None) -> bool:
    return record is not None and record["revoked_at"] is None


def _write_admin_token(store: JobStore, path: Path) -> str:
    token = new_key()
    store.add_token(ADMIN_NAMES[0], hash_token(token), list(SCOPES), ADMIN_OWNER, True)
    path.parent.mkdir(parents=True, exist_ok=True)
    # Created 0600 and renamed into place: never readable by others, not even for a moment.
    part = path.with_name(f".{path.name}.{os.getpid()}")
    part.unlink(missing_ok=True)
    with os.fdopen(os.open(part, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as file:
        file.write(token + "\n")
    os.replace(part, path)
    return token


class Authenticator:
    """Checks a request's key against the stored hashes, read once per change of the key table."""

    def __init__(self, cache: ReadCache) -> None:
        self.cache = cache
        self._touched: dict[str, float] = {}  # key id -> when last_used_at was last written

    def cached_caller(self, headers: list[tuple[bytes, bytes]]) -> Caller | None | object:
        """The caller of a request's raw headers from the cached key table, without waiting: None for
        no or an unknown key, MISSING when the table is not cached."""
        token = token_of(Headers(raw=headers))
        if token is None:
            return None
        records = self.cache.peek("tokens", "tokens")
        return records if records is MISSING else _caller(records, token)

    async def require(self, request: Request, scope: str) -> Caller:
        """The request's caller, kept in `request.state.caller`; a 401 or 403 when it may not."""
        token = token_of(request.headers)
        if token is None:
            raise APIError(401, "missing API key: send 'Authorization: Bearer <key>' or 'X-API-Key: <key>'",
                           "Authorization", "missing_token", CHALLENGE)  # fmt: skip
        caller = _caller(await self.cache.get("tokens", "tokens", self.cache.store.tokens), token)
        if caller is None:
            raise APIError(401, "invalid bearer token", "Authorization", "invalid_token", CHALLENGE)
        if scope == "admin":
            if not caller.admin:
                raise APIError(403, "this route needs the admin token", "Authorization", "insufficient_scope")
            # and the method's scope: a read-only admin key (made before owners) reads only
            scope = "read" if request.method in ("GET", "HEAD") else "write"
        if scope not in caller.scopes:
            raise APIError(
                403, f"this token lacks the '{scope}' scope", "Authorization", "insufficient_scope"
            )
        request.state.caller = caller
        await self._touch(caller.key_id)
        return caller

    async def current(self, request: Request) -> Caller | None:
        """The request's caller as the key table stands now (a live stream asks while it lasts): None once
        its key is revoked or has expired."""
        token = token_of(request.headers)
        records = await self.cache.get("tokens", "tokens", self.cache.store.tokens)
        return None if token is None else _caller(records, token)

    async def _touch(self, key_id: str) -> None:
        now = time.time()
        if now - self._touched.get(key_id, 0.0) >= TOUCH_EVERY_S:
            self._touched[key_id] = now
            await run_in_threadpool(self.cache.store.touch_key, key_id, now)


def token_of(headers: Headers) -> str | None:
    """The key a request sends: its `Authorization: Bearer` token, else its `X-API-Key`."""
    kind, _, token = headers.get("authorization", "").partition(" ")
    if kind.lower() == "bearer" and token.strip():
        return token.strip()
    return headers.get("x-api-key", "").strip() or None


def _caller(records: list[dict[str, Any]], token: str) -> Caller | None:
    digest = hash_token(token)
    found = None
    for record in records:
        if hmac.compare_digest(record["hash"], digest):  # every hash is compared: no timing leak
            found = record
    if found is None or found["revoked_at"] is not None:
        return None
    if found["expires_at"] is not None and found["expires_at"] <= time.time():
        return None
    return Caller(found["id"], found["owner"], tuple(found["scopes"]), found["admin"])
