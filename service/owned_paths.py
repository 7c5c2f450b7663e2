"""Which server paths a spec may name, and for whom (docs/ARCHITECTURE.md §8).

Resolved, a path must lie in the submitter's uploads or jobs' outputs (an admin's: anyone's) or a folder
the operator shares. A refusal reads the same whether the path exists or not. Checked at submission and
again at start, which hands the job the resolved paths: what was checked is what is opened.
"""

from __future__ import annotations

import copy
import logging
import os
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from service.errors import ServiceError
from service.files import CODE_FIELDS, PATH_FIELDS, FileError, FileStore, spec_field
from service.store import JobStore
from service.tracker_policy import TrackerPolicy
from workers.references import is_path_reference

log = logging.getLogger(__name__)

FORK_SOURCES = "fork-sources"  # <home>/jobs/fork-sources/<copy id>/<checkpoint>: a fork's source
COPY_ID = re.compile(r"^[0-9a-f]{12}$")
FOLDER_SCAN_LIMIT = 10_000  # entries looked at for symlinks in one named folder (a model has dozens)


class PathRefused(ServiceError, ValueError):
    """A path the submitter may not name (422); `param` names the field, `code` the reason's kind."""

    def __init__(self, message: str, param: str, code: str = "path_not_allowed") -> None:
        super().__init__(message, 422, param, code)


def refused(param: str, path: str) -> PathRefused:
    return PathRefused(
        f"{param}: '{path[:300]}' is not in your uploads, your jobs' outputs or a folder this service shares; "
        "upload the file (POST /v1/files) and name it by its id, or ask the operator to share its folder "
        "(tandem serve --allow-path)",
        param,
    )


class OwnedPaths:
    """The path rules of one service: its home, its uploads and jobs, the operator's shared folders
    and tracker allow-list."""

    def __init__(self, home: Path, files: FileStore, store: JobStore, shared: Iterable[Path] = (),
                 trackers: TrackerPolicy | None = None) -> None:  # fmt: skip
        self.home = Path(home).expanduser().resolve()
        self.uploads = Path(files.root).expanduser().resolve()
        self.jobs = self.home / "jobs"
        self.files, self.store = files, store
        self.shared = [Path(p).expanduser().resolve() for p in shared]
        self.trackers = trackers or TrackerPolicy()
        for root in self.shared:
            if root.is_relative_to(self.home):
                log.warning("shared folder %s lies in the service's home: the home's rules apply there", root)

    def resolve(self, path: str, param: str, sees: str | None, write: bool = False) -> Path:
        """`path` resolved, when `sees` may name it (to read, or to `write` to); else PathRefused."""
        try:
            if not Path(path).is_absolute():
                raise PathRefused(f"{param}: '{path[:300]}' is not an absolute path; give the whole server "
                                  "path (tandem submit makes a spec file's paths absolute)", param, "invalid_value")  # fmt: skip
            resolved = Path(path).resolve()
            folder = resolved.is_dir()
        except (ValueError, OSError, RuntimeError) as err:  # a NUL byte, a symlink loop, a long name
            raise PathRefused(
                f"{param}: {path[:300]!r} is not a usable path ({err})", param, "invalid_value"
            ) from None
        if not self.may_name(resolved, sees, write):
            raise refused(param, path)
        if not write and folder:
            self._scan(resolved, sees, param, path)
        return resolved

    def may_name(self, resolved: Path, sees: str | None, write: bool = False) -> bool:
        """Whether the owner `sees` (None: the admin) may name an already resolved path."""
        if resolved.is_relative_to(self.uploads) and not write:
            parts = resolved.relative_to(self.uploads).parts
            return bool(parts) and self._owns_upload(parts[0], sees)
        if resolved.is_relative_to(self.jobs):
            parts = resolved.relative_to(self.jobs).parts
            if len(parts) >= 2 and parts[0] == FORK_SOURCES:
                return not write and self._owns_fork_source(parts[1], sees)
            return bool(parts) and parts[0] != FORK_SOURCES and self._owns_job(parts[0], sees)
        if resolved.is_relative_to(self.home) or write:
            return False
        return any(resolved.is_relative_to(root) for root in self.shared)

    def _owns_upload(self, file_id: str, sees: str | None) -> bool:
        try:
            self.files.get(file_id, sees)
        except FileError:
            return False
        return True

    def _owns_job(self, job_id: str, sees: str | None) -> bool:
        job = self.store.get_job(job_id)
        return job is not None and (sees is None or job.owner == sees)

    def _owns_fork_source(self, copy_id: str, sees: str | None) -> bool:
        if not COPY_ID.match(copy_id):
            return False
        return sees is None or sees in self.store.owners_resuming_from(f"/{FORK_SOURCES}/{copy_id}/")

    def _scan(self, folder: Path, sees: str | None, param: str, path: str) -> None:
        """Every symlink under `folder` (and under the folders they lead to) must lead where `sees` may name."""
        todo, seen, looked = [folder], {folder}, 0
        while todo:
            for root, dirs, names in os.walk(todo.pop()):
                for name in dirs + names:
                    looked += 1
                    if looked > FOLDER_SCAN_LIMIT:
                        raise PathRefused(f"{param}: '{path[:300]}' holds more than {FOLDER_SCAN_LIMIT} files; "
                                          "name the model or checkpoint folder itself", param, "too_many_files")  # fmt: skip
                    entry = Path(root, name)
                    if not entry.is_symlink():
                        continue
                    try:
                        target = entry.resolve()
                    except (OSError, RuntimeError):  # a symlink loop
                        raise refused(param, path) from None
                    if not self.may_name(target, sees):
                        raise refused(param, path)
                    if target.is_dir() and target not in seen:
                        seen.add(target)
                        todo.append(target)

    def check_spec(
        self, spec: dict[str, Any], sees: str | None, own_checkpoint: bool = False
    ) -> dict[str, Any]:
        """A copy of a spec dict (upload ids already replaced by paths) with every server path it
        names resolved; PathRefused or TrackerRefused (service/tracker_policy.py) for the first one
        `sees` may not name. `own_checkpoint`: the job resumes from its own, so resume_from is unused."""
        out = copy.deepcopy(spec)
        for keys in PATH_FIELDS:
            holder, value = spec_field(out, keys)
            if isinstance(value, str) and not (own_checkpoint and keys == ("checkpoint", "resume_from")):
                holder[keys[-1]] = str(self.resolve(value, ".".join(keys), sees))
        for keys in CODE_FIELDS:
            holder, value = spec_field(out, keys)
            if isinstance(value, str) and is_path_reference(value):
                source, _, name = value.rpartition(":")
                holder[keys[-1]] = f"{self.resolve(source, '.'.join(keys), sees)}:{name}"
        trainer = out.get("trainer") if isinstance(out.get("trainer"), dict) else {}
        self.trackers.check_loggers(list(trainer.get("loggers") or []))
        uri = trainer.get("mlflow_uri")
        folder = self.trackers.mlflow_folder(uri) if isinstance(uri, str) else None
        if folder is not None:
            trainer["mlflow_uri"] = str(self.resolve(folder, "trainer.mlflow_uri", sees, write=True))
        return out
