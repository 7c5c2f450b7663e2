"""A Tinker training run's checkpoints: `tinker://RUN/KIND/NAME` is the folder `checkpoints/KIND/NAME`
of RUN's workdir, whole once its `.complete` exists; a TTL is the epoch second in its `.expires`. An
expired checkpoint goes when next looked at or swept (`reap`); until then it counts in stored bytes."""

from __future__ import annotations

import datetime as dt
import io
import json
import shutil
import tarfile
import time
from pathlib import Path
from typing import Any

from service.tinker_requests import TinkerError

METHOD = "tinker"
KINDS = {"weights": "training", "sampler_weights": "sampler", "external_weights": "external"}
MAX_TTL_S = 10 * 365 * 86400
REAP_EVERY_S = 60.0


def not_found(what: str, ident: str, field: str) -> TinkerError:
    return TinkerError(404, f"{field}: no {what} '{ident}' (or it is another owner's)", field)


def checkpoint_folder(workdir: Path | str, kind: str, name: str) -> Path:
    return Path(workdir) / "checkpoints" / kind / name


def iso(epoch: float) -> str:
    return dt.datetime.fromtimestamp(epoch, dt.UTC).isoformat()


def expires_at(folder: Path) -> float | None:
    try:
        return float((folder / ".expires").read_text())
    except (OSError, ValueError):
        return None


def set_ttl(folder: Path, ttl_seconds: int | None) -> None:
    if ttl_seconds is None:
        (folder / ".expires").unlink(missing_ok=True)
    else:
        (folder / ".expires").write_text(f"{time.time() + ttl_seconds:.3f}")


def check_ttl(ttl_seconds: int | None, field: str = "ttl_seconds") -> None:
    if ttl_seconds is not None and not 1 <= ttl_seconds <= MAX_TTL_S:
        raise TinkerError(
            400, f"{field}: {ttl_seconds} must be in [1, {MAX_TTL_S}] seconds (or null: kept)", field
        )


def commit(
    store: Any, job_id: str, folder: Path, tinker_path: str, ttl_seconds: int | None, what: str
) -> None:
    """A saved checkpoint becomes whole, and so listed: its TTL, its `.complete`, an event on its run."""
    folder.mkdir(parents=True, exist_ok=True)
    set_ttl(folder, ttl_seconds)
    (folder / ".complete").write_text(tinker_path + "\n")
    if what:
        store.add_event(job_id, "checkpoint", f"saved {what} {tinker_path}")


def is_complete(folder: Path) -> bool:
    """Saved and not expired; an expired checkpoint is removed here."""
    if not (folder / ".complete").exists():
        return False
    ends = expires_at(folder)
    if ends is not None and ends <= time.time():
        shutil.rmtree(folder, ignore_errors=True)
        return False
    return True


def list_checkpoints(job_id: str, workdir: Path | str) -> list[dict[str, Any]]:
    """The run's live checkpoints, oldest first, in the SDK's `Checkpoint` shape."""
    out = []
    for kind, label in KINDS.items():
        root = Path(workdir) / "checkpoints" / kind
        for folder in sorted(root.iterdir()) if root.is_dir() else []:
            if folder.name.startswith(".") or not is_complete(folder):
                continue
            ends = expires_at(folder)
            out.append({
                "checkpoint_id": f"{kind}/{folder.name}", "checkpoint_type": label,
                "time": iso(folder.stat().st_mtime), "tinker_path": f"tinker://{job_id}/{kind}/{folder.name}",
                "size_bytes": sum(f.stat().st_size for f in folder.rglob("*") if f.is_file()),
                "public": False, "expires_at": None if ends is None else iso(ends),
                "mtime": folder.stat().st_mtime,
            })  # fmt: skip
    out.sort(key=lambda c: c.pop("mtime"))
    return out


def parse_tinker_path(path: str) -> tuple[str, str, str] | None:
    """(training run id, kind, name) of `tinker://RUN/KIND/NAME`, or None."""
    parts = path.removeprefix("tinker://").split("/") if path.startswith("tinker://") else []
    if len(parts) != 3 or parts[1] not in KINDS or not parts[0] or not parts[2]:
        return None
    if any(p in (".", "..") or "\\" in p for p in parts):
        return None
    return parts[0], parts[1], parts[2]


def run_row(store: Any, run_id: str, owner: str | None) -> Any:
    """The store's record of Tinker training run `run_id`, if `owner` may see it (None: the admin)."""
    job = store.get_job(run_id)
    return job if job is not None and job.method == METHOD and owner in (None, job.owner) else None


def saved_folder(store: Any, owner: str | None, run_id: str, kind: str, name: str) -> tuple[Any, Path]:
    """(run row, folder) of one of the caller's live checkpoints; a 404 otherwise."""
    job = run_row(store, run_id, owner)
    folder = checkpoint_folder(job.workdir, kind, name) if job is not None and kind in KINDS else None
    if folder is None or name.startswith(".") or "/" in name or not is_complete(folder):
        raise not_found("checkpoint", f"tinker://{run_id}/{kind}/{name}", "checkpoint_id")
    return job, folder


def resolve_state(
    store: Any, path: str, owner: str | None, field: str = "path", kind: str = "weights"
) -> tuple[Any, Path]:
    """(run row, folder) of a caller's `tinker://RUN/KIND/NAME`; 404 for another owner's."""
    parsed = parse_tinker_path(path)
    label = "training" if kind == "weights" else "sampler"
    if parsed is None or parsed[1] != kind:
        raise TinkerError(400, f"{field}: {path!r} is not a {label} checkpoint path "
                          f"(tinker://RUN/{kind}/NAME)", field)  # fmt: skip
    job = run_row(store, parsed[0], owner)
    folder = checkpoint_folder(job.workdir, kind, parsed[2]) if job is not None else None
    if folder is None or not is_complete(folder):
        raise not_found(f"{label} checkpoint" if kind != "weights" else "checkpoint", path, field)
    return job, folder


def delete(store: Any, owner: str | None, run_id: str, kind: str, name: str) -> None:
    job, folder = saved_folder(store, owner, run_id, kind, name)
    shutil.rmtree(folder, ignore_errors=True)
    store.add_event(job.id, "checkpoint", f"deleted tinker://{run_id}/{kind}/{name}")


def reap(store: Any) -> None:
    """Remove every run's expired checkpoints (listing a run's checkpoints removes its expired ones)."""
    for job in store.tinker_runs(None):
        list_checkpoints(job.id, job.workdir)


# ---- training runs -------------------------------------------------------------------------------------


def user_metadata(workdir: Path | str) -> dict[str, str]:
    try:
        return json.loads((Path(workdir) / "user_metadata.json").read_text())
    except (OSError, ValueError):
        return {}


def run_view(job: Any) -> dict[str, Any]:
    saved = list_checkpoints(job.id, job.workdir)
    last = {kind: next((c for c in reversed(saved) if c["checkpoint_type"] == kind), None)
            for kind in ("training", "sampler")}  # fmt: skip
    return {
        "training_run_id": job.id, "base_model": job.spec["model"]["builtin"], "model_owner": job.owner,
        "is_lora": True, "corrupted": False, "lora_rank": job.spec["model"]["lora"]["rank"],
        "last_request_time": iso(job.created_at),
        "last_checkpoint": last["training"], "last_sampler_checkpoint": last["sampler"],
        "user_metadata": {"model_id": job.metadata.get("tinker_model_id", ""), "status": job.status,
                          **user_metadata(job.workdir)},
    }  # fmt: skip


def archive(folder: Path, name: str) -> bytes:
    """A checkpoint as a .tar.gz of its PEFT adapter folder (the host's disk must be this machine's)."""
    source = Path((folder / "SOURCE").read_text()) if (folder / "SOURCE").exists() else folder
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for item in sorted(source.rglob("*")):
            if item.is_file() and not item.name.startswith(".") and item.name != "SOURCE":
                tar.add(item, arcname=f"{name}/{item.relative_to(source)}")
    return buf.getvalue()
