"""Tinker API: sampling sessions, `asample` (and so `compute_logprobs`), samplers, training runs and
their checkpoints: listing, deletion, TTLs, a PEFT archive, and external weights' signed downloads."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Query, Request
from fastapi.responses import FileResponse, Response

from api.routes.tinker_session import caller, future_answer, in_thread, tinker
from api.tinker_bodies import parsed
from service import tinker_checkpoints as saved
from service import tinker_exports as exports
from service import tinker_sampling as sampling
from service.tinker_requests import CheckpointTtl, CreateSamplingSession, Sample
from service.tinker_service import TinkerService

router = APIRouter(prefix="/api/v1", tags=["tinker"], include_in_schema=False)  # the SDK's protocol


@router.post("/create_sampling_session", summary="Tinker: a sampler on a base model or a sampler checkpoint")
async def create_sampling_session(request: Request) -> dict[str, Any]:
    who, body = await caller(request), await parsed(request, CreateSamplingSession)
    sampler_id = await in_thread(sampling.create_sampling_session, tinker(request), who.owner, body)
    return {"type": "create_sampling_session", "sampling_session_id": sampler_id}


@router.post("/asample", summary="Tinker: sample completions (and log-probs) from a sampler")
async def asample(request: Request) -> dict[str, Any]:
    who, body = await caller(request), await parsed(request, Sample)
    future, sequence_ids = await in_thread(sampling.asample, tinker(request), who.owner, body)
    return future_answer(future, sample_sequence_ids=sequence_ids)


@router.get("/samplers/{sampler_id}", summary="Tinker: one sampler")
async def get_sampler(request: Request, sampler_id: str) -> dict[str, Any]:
    who = await caller(request, "read")
    return sampling.sampler_view(tinker(request), who.sees, sampler_id)


def run_of(svc: TinkerService, owner: str | None, run_id: str) -> Any:
    """The caller's training run, named by its id or by its model's id."""
    job = saved.run_row(svc.store, run_id, owner)
    model = svc.records.model(run_id, owner) if job is None else None
    if job is None and model is None:
        raise saved.not_found("training run", run_id, "training_run_id")
    return job or svc.store.get_job(model.job_id)


@router.get("/training_runs", summary="Tinker: the caller's training runs")
async def training_runs(request: Request, limit: int = Query(20, ge=1, le=1000),
                        offset: int = Query(0, ge=0, le=10**9)) -> dict[str, Any]:  # fmt: skip
    who = await caller(request, "read")
    rows = tinker(request).store.tinker_runs(who.sees)  # newest first; an admin's: everyone's
    views = await in_thread(lambda: [saved.run_view(j) for j in rows[offset : offset + limit]])
    return {"training_runs": views, "cursor": {"offset": offset, "limit": limit, "total_count": len(rows)}}


@router.get("/training_runs/{run_id}", summary="Tinker: one training run")
async def training_run(request: Request, run_id: str) -> dict[str, Any]:
    who = await caller(request, "read")
    return await in_thread(lambda: saved.run_view(run_of(tinker(request), who.sees, run_id)))


@router.get("/training_runs/{run_id}/checkpoints", summary="Tinker: a training run's checkpoints")
async def run_checkpoints(request: Request, run_id: str) -> dict[str, Any]:
    who = await caller(request, "read")
    job = run_of(tinker(request), who.sees, run_id)
    return {"checkpoints": await in_thread(saved.list_checkpoints, job.id, job.workdir)}


@router.delete("/training_runs/{run_id}/checkpoints/{kind}/{name}", summary="Tinker: delete a checkpoint")
async def delete_checkpoint(request: Request, run_id: str, kind: str, name: str) -> dict[str, Any]:
    who = await caller(request)
    await in_thread(saved.delete, tinker(request).store, who.sees, run_id, kind, name)
    return {}


@router.put("/training_runs/{run_id}/checkpoints/{kind}/{name}/ttl", summary="Tinker: set or clear a TTL")
async def checkpoint_ttl(request: Request, run_id: str, kind: str, name: str) -> dict[str, Any]:
    who, body = await caller(request), await parsed(request, CheckpointTtl)
    saved.check_ttl(body.ttl_seconds)
    _, folder = await in_thread(saved.saved_folder, tinker(request).store, who.sees, run_id, kind, name)
    saved.set_ttl(folder, body.ttl_seconds)
    return {}


@router.get("/training_runs/{run_id}/checkpoints/{kind}/{name}/archive",
            summary="Tinker: a checkpoint as a .tar.gz of its PEFT adapter folder")  # fmt: skip
async def checkpoint_archive(request: Request, run_id: str, kind: str, name: str) -> Response:
    who = await caller(request, "read")
    _, folder = saved.saved_folder(tinker(request).store, who.sees, run_id, kind, name)
    data = await in_thread(saved.archive, folder, name)
    return Response(data, media_type="application/gzip",
                    headers={"Content-Disposition": f'attachment; filename="{run_id}-{name}.tar.gz"'})  # fmt: skip


@router.get("/training_runs/{run_id}/checkpoints/external_weights/{name}/external_weights_urls",
            summary="Tinker: signed download URLs of external weights")  # fmt: skip
async def external_weights_urls(request: Request, run_id: str, name: str) -> dict[str, Any]:
    who, svc = await caller(request, "read"), tinker(request)
    _, folder = saved.saved_folder(svc.store, who.sees, run_id, "external_weights", name)
    return exports.signed_urls(svc.url_secret, str(request.base_url), run_id, name, folder)


@router.get("/external_weights/{run_id}/{name}/{file}", summary="Tinker: one file of a signed URL (no key)")
async def external_weights_file(
    request: Request, run_id: str, name: str, file: str,
    expires: int = Query(..., ge=0, lt=2**63), signature: str = Query(..., max_length=128),
) -> FileResponse:  # fmt: skip
    svc = tinker(request)
    path = await in_thread(
        exports.signed_file, svc.url_secret, svc.store, run_id, name, file, expires, signature
    )
    return FileResponse(path, media_type="application/octet-stream")
