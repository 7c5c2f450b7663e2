"""API keys in the store (their SHA-256 hashes; api/auth.py makes and checks them): each has an owner
and scopes, may expire, and keeps its row when revoked (the audit log names it). The admin token sees
every owner's work, any other key its owner's only.

`last_used_at` is written under its own change topic ("key_usage"), so that the cached token table
(topic "tokens") is not read again on every request.
"""

from __future__ import annotations

import json
import re
import sqlite3
import time
import uuid
from typing import Any

from service.store_db import StoreDb

KEY_FIELDS = "id, name, hash, scopes, created_at, owner, admin, expires_at, revoked_at, last_used_at"
ADMIN_OWNER = "admin"
OWNER_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._@-]{0,63}$")


# Names no key may be made for: each already means something the service gives no other owner.
RESERVED_OWNERS = {
    ADMIN_OWNER: "the admin token's owner: its work has no quota and every owner's is visible to it",
    "default": "it names the default quota (PUT /v1/quotas/default)",
}


def check_owner(name: str) -> str:
    """An owner's name, or a ValueError saying what a name may hold."""
    if not isinstance(name, str) or not OWNER_NAME.match(name):
        raise ValueError(
            f"owner: '{str(name)[:64]}' must be 1-64 letters, digits, '.', '_', '@' or '-', starting "
            "with a letter or digit"
        )
    if name.lower() in RESERVED_OWNERS:  # 'Admin' too: in logs and listings it reads as the admin
        reason = RESERVED_OWNERS[name.lower()]
        raise ValueError(f"owner: '{name}' is reserved ({reason}); choose another name")
    return name


class KeyTable(StoreDb):
    """The store's API keys (mixed into JobStore)."""

    def add_token(
        self,
        name: str,
        token_hash: str,
        scopes: list[str],
        owner: str = ADMIN_OWNER,
        admin: bool = False,
        expires_at: float | None = None,
    ) -> str:
        token_id = "key-" + uuid.uuid4().hex[:12]
        row = (token_id, name, token_hash, json.dumps(scopes), time.time(), owner, int(admin), expires_at)
        self._insert("tokens", "id, name, hash, scopes, created_at, owner, admin, expires_at", row)
        return token_id

    def tokens(self) -> list[dict[str, Any]]:
        """Every key with its hash (the token check reads these); revoked ones included."""
        return [_record(r) for r in self._rows(f"SELECT {KEY_FIELDS} FROM tokens ORDER BY created_at")]

    def key(self, key_id: str) -> dict[str, Any] | None:
        return next((k for k in self.tokens() if k["id"] == key_id), None)

    def revoke_key(self, key_id: str) -> bool:
        """Revoke a key now; False when there is no such key or it was revoked already."""
        sql = "UPDATE tokens SET revoked_at = ? WHERE id = ? AND revoked_at IS NULL"
        return self._write(sql, (time.time(), key_id), "tokens") == 1

    def touch_key(self, key_id: str, at: float) -> None:
        self._write("UPDATE tokens SET last_used_at = ? WHERE id = ?", (at, key_id), "key_usage")

    def key_owners(self) -> list[str]:
        return [r[0] for r in self._rows("SELECT DISTINCT owner FROM tokens WHERE revoked_at IS NULL")]


def _record(row: sqlite3.Row) -> dict[str, Any]:
    return {**dict(row), "scopes": json.loads(row["scopes"]), "admin": bool(row["admin"])}


def public_key(record: dict[str, Any]) -> dict[str, Any]:
    """A key as the API lists it: never its hash."""
    expired = record["expires_at"] is not None and record["expires_at"] <= time.time()
    state = "revoked" if record["revoked_at"] else "expired" if expired else "active"
    return {"object": "key", **{k: v for k, v in record.items() if k != "hash"}, "state": state}
