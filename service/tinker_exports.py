"""External weights: a model's PEFT adapter files as `tinker://RUN/external_weights/NAME` (age-encrypted
when asked), behind URLs this service signs, so a client downloads them without its key."""

from __future__ import annotations

import hashlib
import hmac
import secrets
import shutil
import time
from pathlib import Path
from typing import Any

from service import tinker_checkpoints as saved
from service.tinker_futures import Future
from service.tinker_requests import SaveExternal, TinkerError
from service.tinker_service import NAME, TinkerService
from workers.session_host import SessionWorker

URL_TTL_S = 3600


def save_external(svc: TinkerService, owner: str, req: SaveExternal) -> Future:
    model = svc.model(req.model_id, owner)
    if not NAME.match(req.path):
        raise TinkerError(400, f"path: name {req.path!r} must match {NAME.pattern}", "path")
    saved.check_ttl(req.ttl_seconds)
    recipients = age_recipients(req.age_encryption_recipients)
    folder = saved.checkpoint_folder(model.workdir, "external_weights", req.path)
    if saved.is_complete(folder):
        raise TinkerError(400, f"path: external weights '{req.path}' exist (delete them first)", "path")
    shutil.rmtree(folder, ignore_errors=True)  # an expired or unfinished export of that name
    staging = folder.parent / f".{req.path}.{secrets.token_hex(4)}"
    tinker_path = f"tinker://{model.job_id}/external_weights/{req.path}"
    answer = {"path": tinker_path, "type": "save_weights_external"}

    def exported(ok: Any) -> None:
        answer["size_bytes"] = export_files(staging, folder, recipients)
        saved.commit(svc.store, model.job_id, folder, tinker_path, req.ttl_seconds, "external weights")

    kwargs = {"path": str(staging), "optimizer": False}
    return svc.on_model(model, SessionWorker.save_state, kwargs, answer, exported)


def export_files(staging: Path, folder: Path, recipients: list[Any]) -> int:
    """The PEFT files of a saved adapter into `folder` (encrypted to `recipients`, `.age`); its bytes."""
    folder.mkdir(parents=True)
    for item in sorted(staging.glob("adapter_*")):
        if recipients:
            import pyrage

            (folder / f"{item.name}.age").write_bytes(pyrage.encrypt(item.read_bytes(), recipients))
        else:
            shutil.copyfile(item, folder / item.name)
    shutil.rmtree(staging, ignore_errors=True)
    return sum(f.stat().st_size for f in folder.iterdir())


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
    return {"urls": urls, "expires": saved.iso(expires)}


def signed_file(secret: bytes, store: Any, run_id: str, name: str, file: str, expires: int, sig: str) -> Path:
    """The file a signed URL names, if its signature holds and it has not expired; else a 404."""
    good = hmac.compare_digest(sig, signature(secret, run_id, name, file, expires))
    if good and expires > time.time():
        job = saved.run_row(store, run_id, None)
        folder = saved.checkpoint_folder(job.workdir, "external_weights", name) if job is not None else None
        if folder is not None and saved.is_complete(folder) and file in {f.name for f in folder.iterdir()}:
            return folder / file
    raise saved.not_found(
        "signed external weights file (or the URL expired)", f"{run_id}/{name}/{file}", "signature"
    )
