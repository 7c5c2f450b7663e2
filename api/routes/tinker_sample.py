"""Tinker API: sampling sessions, `asample` (and so `compute_logprobs`), samplers, training runs,
their checkpoints, and a checkpoint's download as a PEFT adapter archive (.tar.gz)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Query, Request
from fastapi.responses import Response

from api.routes.tinker_session import caller, future_answer, tinker
from api.tinker_bodies import parsed
from service import tinker_sampling as sampling
from service.tinker_requests import CreateSamplingSession, Sample
from service.tinker_sessions import list_checkpoints

router = APIRouter(
    prefix="/api/v1", tags=["tinker"], include_in_schema=False
)  # the SDK's protocol: docs/tinker.md


@router.post("/create_sampling_session", summary="Tinker: a sampler on a base model or a sampler checkpoint")
async def create_sampling_session(request: Request) -> dict[str, Any]:
    who = await caller(request)
    sampler_id = sampling.create_sampling_session(
        tinker(request), who.owner, await parsed(request, CreateSamplingSession)
    )
    return {"type": "create_sampling_session", "sampling_session_id": sampler_id}


@router.post("/asample", summary="Tinker: sample completions (and log-probs) from a sampler")
async def asample(request: Request) -> dict[str, Any]:
    who = await caller(request)
    future, sequence_ids = sampling.asample(tinker(request), who.owner, await parsed(request, Sample))
    return future_answer(future, sample_sequence_ids=sequence_ids)


@router.get("/samplers/{sampler_id}", summary="Tinker: one sampler")
async def get_sampler(request: Request, sampler_id: str) -> dict[str, Any]:
    who = await caller(request, "read")
    return sampling.sampler_view(tinker(request), who.sees, sampler_id)


@router.get("/training_runs", summary="Tinker: the caller's training runs")
async def training_runs(request: Request, limit: int = Query(20, ge=1, le=1000),
                        offset: int = Query(0, ge=0, le=10**9)) -> dict[str, Any]:  # fmt: skip
    who = await caller(request, "read")
    return sampling.list_runs(tinker(request), who.sees, limit, offset)


@router.get("/training_runs/{run_id}", summary="Tinker: one training run")
async def training_run(request: Request, run_id: str) -> dict[str, Any]:
    who = await caller(request, "read")
    svc = tinker(request)
    return sampling.run_view(svc, sampling.run_of(svc, who.sees, run_id))


@router.get("/training_runs/{run_id}/checkpoints", summary="Tinker: a training run's checkpoints")
async def run_checkpoints(request: Request, run_id: str) -> dict[str, Any]:
    who = await caller(request, "read")
    job = sampling.run_of(tinker(request), who.sees, run_id)
    return {"checkpoints": list_checkpoints(job.id, job.workdir)}


@router.get("/training_runs/{run_id}/checkpoints/{kind}/{name}/archive",
            summary="Tinker: a checkpoint as a .tar.gz of its PEFT adapter folder")  # fmt: skip
async def checkpoint_archive(request: Request, run_id: str, kind: str, name: str) -> Response:
    who = await caller(request, "read")
    data = sampling.checkpoint_archive(tinker(request), who.sees, run_id, kind, name)
    return Response(data, media_type="application/gzip",
                    headers={"Content-Disposition": f'attachment; filename="{run_id}-{name}.tar.gz"'})  # fmt: skip
