"""Uploaded files (data, Python modules, LoRA adapters) under the service's home, so a remote user never
needs a path on the server: `$TANDEM_HOME/files/<id>/<filename>` plus `meta.json`.

A spec names an upload by its id (`data.train_path: "file-0123456789ab"`, `reward.function:
"file-0123456789ab:score"`); `resolve_refs` replaces ids with paths when a job is checked and when it
starts. Every read takes `sees`, the caller's owner (None for an admin): another owner's file is
"no file" to it.
"""

from __future__ import annotations

import copy
import json
import re
import shutil
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import anyio

from service.errors import ServiceError
from service.keys import ADMIN_OWNER

FILE_ID = re.compile(r"^file-[0-9a-f]{12}$")
# an upload's purpose by its suffix (an adapter: a LoRA adapter's tensors, model.lora.init_from)
DATA = (".jsonl", ".jsonlines", ".json", ".parquet", ".pq")
PURPOSES = {**dict.fromkeys(DATA, "data"), ".py": "code", ".safetensors": "adapter"}
SAFE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
# spec fields that hold a server path, and those that hold 'path/file.py:name' or another reference
PATH_FIELDS = (
    ("data", "train_path"),
    ("data", "val_path"),
    ("model", "path"),
    ("model", "critic_path"),
    ("model", "lora", "init_from"),
    ("reward", "model_path"),
    ("checkpoint", "resume_from"),
)
CODE_FIELDS = (("reward", "function"), ("rollout", "environment"), ("rollout", "external", "agent"))
# the spec fields that may name an upload, and whether the value is "ref:function"
REF_FIELDS = {
    ("data", "train_path"): False,
    ("data", "val_path"): False,
    ("reward", "function"): True,
    ("model", "lora", "init_from"): False,
}


class FileError(ServiceError, ValueError):
    """An upload or a file reference that cannot be used; `param` names the field at fault."""

    def __init__(
        self, message: str, param: str | None = None, status: int = 422, code: str | None = None
    ) -> None:
        super().__init__(message, status, param, code or ("not_found" if status == 404 else "invalid_value"))


@dataclass
class FileRecord:
    id: str
    filename: str
    bytes: int
    purpose: str  # "data", "code" or "adapter"
    created_at: float
    object: str = "file"
    owner: str = ADMIN_OWNER


def spec_field(spec: dict[str, Any], keys: tuple[str, ...]) -> tuple[dict[str, Any] | None, Any]:
    """(the dict holding the last of `keys`, its value) in a nested spec dict; (None, None) where a
    section is missing."""
    holder: Any = spec
    for section in keys[:-1]:
        holder = holder.get(section) if isinstance(holder, dict) else None
    return (holder, holder.get(keys[-1])) if isinstance(holder, dict) else (None, None)


def check_filename(filename: str) -> str:
    """The upload's purpose (PURPOSES) from its name; a FileError for any other name."""
    if not SAFE_NAME.match(filename):
        raise FileError(f"filename: '{filename[:64]}' must be a plain name of letters, digits, '.', '_' or '-'",
                        "filename")  # fmt: skip
    purpose = PURPOSES.get(Path(filename).suffix.lower())
    if purpose is None:
        raise FileError(f"filename: '{filename}' must end in one of {', '.join(PURPOSES)}", "filename")
    return purpose


class FileStore:
    def __init__(self, root: Path) -> None:
        self.root = root

    async def save(self, filename: str, chunks: AsyncIterator[bytes], owner: str = ADMIN_OWNER) -> FileRecord:
        """Store a stream as a new file (written off the event loop); removed again if the stream fails."""
        purpose = check_filename(filename)
        file_id = "file-" + uuid.uuid4().hex[:12]
        folder = self.root / file_id
        folder.mkdir(parents=True, mode=0o700)
        size = 0
        try:
            with (folder / filename).open("wb") as out:
                async for chunk in chunks:
                    size += len(chunk)
                    await anyio.to_thread.run_sync(out.write, chunk)
            if size == 0:
                raise FileError("body: the upload is empty", "body")
        except BaseException:
            shutil.rmtree(folder, ignore_errors=True)
            raise
        record = FileRecord(file_id, filename, size, purpose, time.time(), owner=owner)
        (folder / "meta.json").write_text(json.dumps(asdict(record)))
        return record

    def get(self, file_id: str, sees: str | None = None) -> FileRecord:
        meta = self.root / file_id / "meta.json" if FILE_ID.match(file_id) else None
        record = FileRecord(**json.loads(meta.read_text())) if meta is not None and meta.is_file() else None
        if record is None or (sees is not None and record.owner != sees):
            raise FileError(f"no file '{file_id[:64]}'", "file_id", 404)
        return record

    def path(self, file_id: str, sees: str | None = None) -> Path:
        record = self.get(file_id, sees)
        return self.root / record.id / record.filename

    def records(self, sees: str | None = None) -> list[FileRecord]:
        if not self.root.is_dir():
            return []
        found = [self.get(p.name) for p in self.root.iterdir() if (p / "meta.json").is_file()]
        found = [r for r in found if sees is None or r.owner == sees]
        return sorted(found, key=lambda r: r.created_at, reverse=True)

    def delete(self, file_id: str, sees: str | None = None) -> None:
        self.get(file_id, sees)
        shutil.rmtree(self.root / file_id)

    def resolve_refs(self, spec: dict[str, Any], sees: str | None = None) -> dict[str, Any]:
        """A copy of a spec dict with every upload id replaced by its stored path; with `sees`, only
        that owner's uploads resolve."""
        out = copy.deepcopy(spec)
        for path, has_function in REF_FIELDS.items():
            holder, value = spec_field(out, path)
            if not isinstance(value, str):
                continue
            ref, sep, function = value.partition(":") if has_function else (value, "", "")
            if FILE_ID.match(ref):
                field = ".".join(path)
                try:
                    holder[path[-1]] = str(self.path(ref, sees)) + sep + function
                except FileError:
                    raise FileError(
                        f"{field}: no uploaded file '{ref}' (GET /v1/files lists them)",
                        field,
                        code="not_found",
                    ) from None
        return out
