"""`tandem files upload|list|delete`: data and reward modules uploaded to the service; specs name
them by id (file-...)."""

from __future__ import annotations

import argparse
from typing import Any

from api.cli_format import clock, table
from api.client import TandemClient


def upload_command(args: argparse.Namespace, client: TandemClient) -> int:
    for path in args.paths:
        record = client.upload_file(path)
        print(f"{record['id']}  {record['filename']}  {record['bytes']} bytes", flush=True)
    return 0


def list_command(args: argparse.Namespace, client: TandemClient) -> int:
    found = client.list_files()["data"]
    rows = [(f["id"], f["filename"], str(f["bytes"]), f["purpose"], clock(f["created_at"])) for f in found]
    print(table(("ID", "NAME", "BYTES", "PURPOSE", "UPLOADED"), rows) if rows else "no files")
    return 0


def delete_command(args: argparse.Namespace, client: TandemClient) -> int:
    client.delete_file(args.file_id)
    print(f"{args.file_id} deleted")
    return 0


def add_files_parser(sub: Any, conn: argparse.ArgumentParser) -> None:
    files = sub.add_parser(
        "files", help="upload data and reward modules; specs name them by id"
    ).add_subparsers(dest="files_command", required=True)
    p = files.add_parser("upload", parents=[conn], help="upload files; prints each one's id (file-...)")
    p.add_argument("paths", nargs="+", metavar="PATH", help=".jsonl/.json/.parquet data or a .py module")
    p.set_defaults(func=upload_command, client=True)
    files.add_parser("list", parents=[conn], help="uploaded files").set_defaults(
        func=list_command, client=True
    )
    p = files.add_parser("delete", parents=[conn], help="delete an uploaded file")
    p.add_argument("file_id", metavar="ID")
    p.set_defaults(func=delete_command, client=True)
