"""A Tinker training run's checkpoints: `tinker://RUN/KIND/NAME` is the folder `checkpoints/KIND/NAME`
of RUN's workdir, whole once its `.complete` exists; a TTL is the epoch second in its `.expires`. An
expired checkpoint goes when next looked at or swept (`reap`); until then it counts in stored bytes.
External weights are a model's PEFT files (age-encrypted when asked) behind URLs this service signs,
so a client downloads them without its key."""

from __future__ import annotations

import contextlib
import datetime as dt
import hashlib
import hmac
import io
import json
import re
import secrets
import shutil
import tarfile
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

from service.tinker_requests import SaveWeights, TinkerError, not_found
from service.tinker_sessions import Future, Sampler
from workers.session_host import SessionWorker

if TYPE_CHECKING:
    from service.tinker_service import TinkerService

METHOD = "tinker"
KINDS = {"weights": "training", "sampler_weights": "sampler", "external_weights": "external"}
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
REAP_EVERY_S = 60.0
URL_TTL_S = 3600


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


def lost_message(job_id: str, workdir: Path, cause: str = "the service restarted") -> str:
    """Why the run is gone, and the newest training checkpoint (save_state) to continue from."""
    states = [c for c in list_checkpoints(job_id, workdir) if c["checkpoint_type"] == "training"]
    if not states:
        return (f"training run {job_id} was lost when {cause}, and it saved no state "
                "(save_state): create a new training client")  # fmt: skip
    last = states[-1]["tinker_path"]
    return (f"training run {job_id} was lost when {cause}; its last saved state is {last}: "
            f"continue with service_client.create_training_client_from_state_with_optimizer('{last}')")  # fmt: skip


def run_row(store: Any, run_id: str, owner: str | None) -> Any:
    """The store's record of Tinker training run `run_id`, if `owner` may see it (None: the admin)."""
    job = store.get_job(run_id)
    return job if job is not None and job.method == METHOD and owner in (None, job.owner) else None


def saved_folder(
    store: Any, owner: str | None, run_id: str, kind: str, name: str, field: str = "checkpoint_id"
) -> tuple[Any, Path]:
    """(run row, folder) of one of the caller's live checkpoints; a 404 naming `field` otherwise."""
    job = run_row(store, run_id, owner)
    folder = checkpoint_folder(job.workdir, kind, name) if job is not None and kind in KINDS else None
    if folder is None or name.startswith(".") or "/" in name or not is_complete(folder):
        raise not_found("checkpoint", f"tinker://{run_id}/{kind}/{name}", field)
    return job, folder


def resolve_state(
    store: Any, path: str, owner: str | None, field: str = "path", kind: str = "weights"
) -> tuple[Any, Path]:
    """(run row, folder) of a caller's `tinker://RUN/KIND/NAME`; 404 for another owner's."""
    parts = path.removeprefix("tinker://").split("/") if path.startswith("tinker://") else []
    if len(parts) != 3 or parts[1] != kind or any(p in ("", ".", "..") or "\\" in p for p in parts):
        raise TinkerError(400, f"{field}: {path!r} is not a {KINDS[kind]} checkpoint path "
                          f"(tinker://RUN/{kind}/NAME)", field)  # fmt: skip
    return saved_folder(store, owner, parts[0], kind, parts[2], field)


def delete(svc: TinkerService, owner: str | None, run_id: str, kind: str, name: str) -> None:
    job, folder = saved_folder(svc.store, owner, run_id, kind, name)
    shutil.rmtree(folder, ignore_errors=True)
    svc.store.add_event(job.id, "checkpoint", f"deleted tinker://{run_id}/{kind}/{name}")


def run_view(job: Any) -> dict[str, Any]:
    saved = list_checkpoints(job.id, job.workdir)
    last = {kind: next((c for c in reversed(saved) if c["checkpoint_type"] == kind), None)
            for kind in ("training", "sampler")}  # fmt: skip
    try:
        user_metadata = json.loads((Path(job.workdir) / "user_metadata.json").read_text())
    except (OSError, ValueError):
        user_metadata = {}
    return {
        "training_run_id": job.id, "base_model": job.spec["model"]["builtin"], "model_owner": job.owner,
        "is_lora": True, "corrupted": False, "lora_rank": job.spec["model"]["lora"]["rank"],
        "last_request_time": iso(job.created_at),
        "last_checkpoint": last["training"], "last_sampler_checkpoint": last["sampler"],
        "user_metadata": {"model_id": job.metadata.get("tinker_model_id", ""), "status": job.status,
                          **user_metadata},
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


# ---- the saves: save_state, save_weights_for_sampler, save_weights_external ----------------------------


def _named(name: str | None, job_id: str, kind: str) -> str:
    """The `tinker://` path a save of `name` will have; a 400 for a name that is not a folder's."""
    if not NAME.match(name or ""):
        raise TinkerError(400, f"path: name {name!r} must match {NAME.pattern}", "path")
    return f"tinker://{job_id}/{kind}/{name}"


def _has_room(svc: TinkerService, owner: str) -> None:
    """A checkpoint's save past its owner's stored bytes is a 403 naming the quota, as a job's submission."""
    if svc.quotas.of(owner).stored_bytes is not None:
        svc.service.check_storage(owner, adding=1)


def save_state(svc: TinkerService, owner: str, req: SaveWeights) -> Future:
    model = svc.model(req.model_id, owner)
    _has_room(svc, owner)
    name = req.path or f"step-{model.step:06d}"
    path, folder = _named(name, model.job_id, "weights"), checkpoint_folder(model.workdir, "weights", name)
    if is_complete(folder) and not req.overwrite:
        raise TinkerError(400, f"path: checkpoint '{name}' exists (pass overwrite)", "path")

    def saved(ok: Any) -> dict[str, Any]:
        commit(svc.store, model.job_id, folder, path, req.ttl_seconds, "state")
        return {"path": path, "type": "save_weights"}

    return svc.on_model(model, SessionWorker.save_state, {"path": str(folder)}, saved)


def save_for_sampler(svc: TinkerService, owner: str, req: SaveWeights) -> Future:
    """A frozen snapshot to sample; named, it is saved as a listed checkpoint (in its owner's stored bytes,
    and gone when that is deleted)."""
    model = svc.model(req.model_id, owner)
    if req.kind != "snapshot":
        raise TinkerError(400, f"kind: only 'snapshot' samplers are served (not {req.kind!r})", "kind")
    name = req.path
    path = _named(name, model.job_id, "sampler_weights") if name is not None else None
    folder = checkpoint_folder(model.workdir, "sampler_weights", name) if path else None
    if folder is not None:
        _has_room(svc, owner)
        if is_complete(folder):  # the SDK's call has no `overwrite`: samplers and downloads may use it
            raise TinkerError(400, f"path: sampler weights '{name}' exist (delete them first)", "path")
    sampler_id = f"{model.session_id}:sample:{uuid.uuid4().hex[:8]}"

    def saved(ok: dict[str, Any]) -> dict[str, Any]:
        sampler = Sampler(sampler_id, owner, model.base_model, ok["path"], path, model.job_id)
        svc.drop_snapshots(svc.records.add_sampler(sampler))
        if folder is None:
            return {"sampling_session_id": sampler_id, "type": "save_weights_for_sampler"}
        (folder / "SOURCE").write_text(ok["path"])
        commit(svc.store, model.job_id, folder, path, req.ttl_seconds, "")
        return {"path": path, "type": "save_weights_for_sampler"}

    kwargs = {"name": name or sampler_id.replace(":", "-"), "path": folder and str(folder)}
    return svc.on_model(model, SessionWorker.save_for_sampler, kwargs, saved)


def save_external(svc: TinkerService, owner: str, req: SaveWeights) -> Future:
    model = svc.model(req.model_id, owner)
    _has_room(svc, owner)
    path = _named(req.path, model.job_id, "external_weights")
    recipients = age_recipients(req.age_encryption_recipients)
    folder = checkpoint_folder(model.workdir, "external_weights", req.path)
    if is_complete(folder):
        raise TinkerError(400, f"path: external weights '{req.path}' exist (delete them first)", "path")
    shutil.rmtree(folder, ignore_errors=True)  # an expired or unfinished export of that name
    staging = folder.parent / f".{req.path}.{secrets.token_hex(4)}"

    def exported(ok: Any) -> dict[str, Any]:
        folder.mkdir(parents=True)
        for item in sorted(staging.glob("adapter_*")):
            if recipients:
                import pyrage

                (folder / f"{item.name}.age").write_bytes(pyrage.encrypt(item.read_bytes(), recipients))
            else:
                shutil.copyfile(item, folder / item.name)
        shutil.rmtree(staging, ignore_errors=True)
        size = sum(f.stat().st_size for f in folder.iterdir())
        commit(svc.store, model.job_id, folder, path, req.ttl_seconds, "external weights")
        return {"path": path, "type": "save_weights_external", "size_bytes": size}

    kwargs = {"path": str(staging), "optimizer": False}
    return svc.on_model(model, SessionWorker.save_state, kwargs, exported)


def age_recipients(given: list[str] | None) -> list[Any]:
    if not given:
        return []
    try:
        import pyrage
    except ImportError:
        why = "unsupported feature: age_encryption_recipients needs the pyrage package on the service"
        raise TinkerError(
            400, f"{why} (pip install 'tandem[cookbook]')", "age_encryption_recipients"
        ) from None
    out = []
    for i, text in enumerate(given):
        try:
            out.append(pyrage.x25519.Recipient.from_str(text))
        except Exception:  # noqa: BLE001 - pyrage raises its own error types for a bad key
            field = f"age_encryption_recipients[{i}]"
            raise TinkerError(400, f"{field}: not an age X25519 recipient (age1...)", field) from None
    return out


def signature(secret: bytes, run_id: str, name: str, file: str, expires: int) -> str:
    return hmac.new(secret, f"{run_id}/{name}/{file}/{expires}".encode(), hashlib.sha256).hexdigest()


def signed_urls(secret: bytes, base_url: str, run_id: str, name: str, folder: Path) -> dict[str, Any]:
    """The SDK's `ExternalWeightsUrlsResponse`: one URL per file, valid for URL_TTL_S."""
    expires = int(time.time()) + URL_TTL_S
    urls = {f.name: f"{base_url.rstrip('/')}/api/v1/external_weights/{run_id}/{name}/{f.name}?expires={expires}"
            f"&signature={signature(secret, run_id, name, f.name, expires)}"
            for f in sorted(folder.iterdir()) if f.is_file() and not f.name.startswith(".")}  # fmt: skip
    return {"urls": urls, "expires": iso(expires)}


def signed_file(secret: bytes, store: Any, run_id: str, name: str, file: str, expires: int, sig: str) -> Path:
    """The file a signed URL names, if its signature holds and it has not expired; else a 404."""
    if hmac.compare_digest(sig, signature(secret, run_id, name, file, expires)) and expires > time.time():
        with contextlib.suppress(TinkerError):  # a checkpoint gone since: the same 404
            folder = saved_folder(store, None, run_id, "external_weights", name)[1]
            if file in {f.name for f in folder.iterdir()}:
                return folder / file
    raise not_found(
        "signed external weights file (or the URL expired)", f"{run_id}/{name}/{file}", "signature"
    )
