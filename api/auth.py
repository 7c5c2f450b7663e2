"""Bearer tokens with read and write scopes, stored as SHA-256 hashes and compared in constant time.

Tokens are 32 random bytes, so a plain hash is enough at rest (no password stretching needed).
The first start of a service creates an admin token (read + write), writes it to
`$TANDEM_HOME/admin_token` with mode 600, and keeps only its hash; TANDEM_ADMIN_TOKEN, when set,
is registered instead (for a Kubernetes Secret). The check reads the stored hashes through the
read cache (api/read_cache.py): once per change of the store, not once per request.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from pathlib import Path
from typing import Any

from fastapi import Request

from api.errors import APIError
from api.read_cache import MISSING, ReadCache
from service.store import JobStore

SCOPES = ("read", "write")
CHALLENGE = {"WWW-Authenticate": 'Bearer realm="tandem"'}


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def new_token() -> str:
    return "tdm_" + secrets.token_urlsafe(32)


def ensure_admin_token(store: JobStore, home: Path) -> Path:
    """Register the admin token once; returns the file that holds it."""
    path = home / "admin_token"
    given = os.environ.get("TANDEM_ADMIN_TOKEN")
    known = {t["hash"] for t in store.tokens()}
    if given:
        if hash_token(given) not in known:
            store.add_token("admin (TANDEM_ADMIN_TOKEN)", hash_token(given), list(SCOPES))
        return path
    if path.exists() and hash_token(path.read_text().strip()) in known:
        return path
    token = new_token()
    store.add_token("admin", hash_token(token), list(SCOPES))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(token + "\n")
    path.chmod(0o600)
    return path


class Authenticator:
    """Checks a request's bearer token against the stored hashes, read once per change of the store."""

    def __init__(self, cache: ReadCache) -> None:
        self.cache = cache

    async def scopes_of(self, token: str) -> list[str] | None:
        return _scopes(await self.cache.get("tokens", "tokens", self.cache.store.tokens), token)

    def cached_scopes(self, header: str) -> Any:
        """The scopes of an Authorization header's bearer token from the cached token table, without
        waiting: None for no or an unknown token, MISSING when the table is not cached."""
        token = bearer_token(header)
        if token is None:
            return None
        records = self.cache.peek("tokens", "tokens")
        return records if records is MISSING else _scopes(records, token)

    async def require(self, request: Request, scope: str) -> None:
        token = bearer_token(request.headers.get("authorization", ""))
        if token is None:
            raise APIError(401, "missing bearer token: send 'Authorization: Bearer <token>'", "Authorization",
                           "missing_token", CHALLENGE)  # fmt: skip
        scopes = await self.scopes_of(token)
        if scopes is None:
            raise APIError(401, "invalid bearer token", "Authorization", "invalid_token", CHALLENGE)
        if scope not in scopes:
            raise APIError(
                403, f"this token lacks the '{scope}' scope", "Authorization", "insufficient_scope"
            )


def bearer_token(header: str) -> str | None:
    """The token of an `Authorization: Bearer <token>` header, None when it is not one."""
    kind, _, token = header.partition(" ")
    return token.strip() if kind.lower() == "bearer" and token else None


def _scopes(records: list[dict[str, Any]], token: str) -> list[str] | None:
    digest = hash_token(token)
    found = None
    for record in records:
        if hmac.compare_digest(record["hash"], digest):  # every hash is compared: no timing leak
            found = record["scopes"]
    return found
