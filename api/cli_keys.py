"""`tandem keys create|list|revoke` (admin): API keys for owners. A new key is printed alone on the
last line of `create`'s output, and nowhere else; `list` never shows a key, only its id."""

from __future__ import annotations

import argparse
import time
from typing import Any

from api.cli_format import table
from api.client import TandemClient


def create_command(args: argparse.Namespace, client: TandemClient) -> int:
    made = client.create_key(args.owner, args.scope, args.expires, args.name or "")
    expires = _when(made["expires_at"]) if made["expires_at"] else "never"
    print(f"created {made['id']} for owner '{made['owner']}' (scopes {','.join(made['scopes'])}; "
          f"expires {expires}); the key is shown once, on the next line:")  # fmt: skip
    print(made["key"])
    return 0


def list_command(args: argparse.Namespace, client: TandemClient) -> int:
    keys = client.list_keys(args.owner)["data"]
    rows = [
        (k["id"], k["owner"], ",".join(k["scopes"]) + (" (admin)" if k["admin"] else ""), _when(k["created_at"]),
         _when(k["last_used_at"]), _when(k["expires_at"]), k["state"])
        for k in keys
    ]  # fmt: skip
    print(
        table(("ID", "OWNER", "SCOPES", "CREATED", "LAST USED", "EXPIRES", "STATE"), rows)
        if rows
        else "no keys"
    )
    return 0


def revoke_command(args: argparse.Namespace, client: TandemClient) -> int:
    revoked = client.revoke_key(args.key_id)
    print(f"{revoked['id']} ({revoked['owner']}) revoked")
    return 0


def _when(at: float | None) -> str:
    return time.strftime("%Y-%m-%d %H:%M", time.localtime(at)) if at else "-"


def add_keys_parser(sub: Any, conn: argparse.ArgumentParser) -> None:
    keys = sub.add_parser(
        "keys", help="API keys for owners (admin): each owner sees only their own jobs and files"
    ).add_subparsers(dest="keys_command", required=True)
    p = keys.add_parser("create", parents=[conn], help="a new key; printed alone on the last line")
    p.add_argument("--owner", required=True, help="who the key acts for")
    p.add_argument("--scope", choices=("read", "write"), default="write", help="write (default) or read only")
    p.add_argument("--expires", type=float, metavar="DAYS", help="the key stops working after DAYS days")
    p.add_argument("--name", help="a note on what the key is for")
    p.set_defaults(func=create_command, client=True)
    p = keys.add_parser("list", parents=[conn], help="keys: id, owner, scopes, times; never the key")
    p.add_argument("--owner", help="only this owner's keys")
    p.set_defaults(func=list_command, client=True)
    p = keys.add_parser("revoke", parents=[conn], help="revoke a key: refused from its next request on")
    p.add_argument("key_id", metavar="ID")
    p.set_defaults(func=revoke_command, client=True)
