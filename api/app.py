"""The REST control plane: FastAPI routes over the Service, under /v1, with bearer-token auth.

Conventions (DESIGN.md §6): lists are {"object": "list", "data", "has_more"} with after/limit
cursors; errors are {"error": {...}} naming the field at fault; every response carries
x-request-id; POST /v1/jobs honours Idempotency-Key. Open without a token: /healthz, /readyz and the
dashboard's static page and assets (they hold no data; the page asks the API with the token).
"""

from __future__ import annotations

import hashlib
import json
import time
import uuid
from pathlib import Path
from typing import Any

import ray
from fastapi import Body, Depends, FastAPI, Query, Request, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ConfigDict, Field

from api.auth import Authenticator
from api.dashboard import mount_dashboard
from api.errors import APIError, install_error_handlers
from api.prom import make_registry
from api.streams import sse, start_id
from api.validation import check_submittable
from controller.rewards import RewardFunctionError, RewardScorer
from controller.service import Service
from controller.spec import JobSpec
from controller.store import TERMINAL, JobRecord

VERSION = "0.1.0"


class ForkRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    checkpoint_step: int | None = Field(
        None, description="the parent's checkpoint to start from; None = latest"
    )
    overrides: dict[str, Any] = Field(default_factory=dict, description="JobSpec fields to change, nested")


class RewardRow(BaseModel):
    model_config = ConfigDict(extra="forbid")
    prompt: str = ""
    response: str
    ground_truth: Any = None
    extra: dict[str, Any] | None = None


class RewardValidateRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    function: str = Field(..., description="'builtin:NAME', 'module:function' or 'path/file.py:function'")
    rows: list[RewardRow] = Field(..., min_length=1, max_length=1000)


def job_view(job: JobRecord) -> dict[str, Any]:
    spec = job.spec
    model = spec["model"].get("builtin") or spec["model"].get("path")
    return {
        "id": job.id,
        "object": "job",
        "status": job.status,
        "method": job.method,
        "model": model,
        "created_at": job.created_at,
        "started_at": job.started_at,
        "finished_at": job.finished_at,
        "step": job.step,
        "total_steps": job.total_steps,
        "progress": job.step / job.total_steps if job.total_steps else 0.0,
        "latest_metrics": job.latest_metrics,
        "error": job.error,
        "parent_id": job.parent_id,
        "metadata": job.metadata,
        "outputs": _outputs(job),
        "spec": spec,
    }


def _outputs(job: JobRecord) -> dict[str, str | None]:
    """Where the job writes on the server: its folder, and the HF export once it exists."""
    export = Path(job.workdir) / "export"
    return {"workdir": job.workdir, "export": str(export) if (export / "config.json").exists() else None}


def listing(data: list[Any], has_more: bool) -> dict[str, Any]:
    return {"object": "list", "data": data, "has_more": has_more}


def create_app(service: Service) -> FastAPI:
    app = FastAPI(title="Tandem", version=VERSION, description="RL post-training jobs: submit, watch, steer.")
    install_error_handlers(app)
    auth = Authenticator(service.store)
    registry, latency = make_registry(service.store)
    app.state.service = service

    def reader(request: Request) -> None:
        auth.require(request, "read")

    def writer(request: Request) -> None:
        auth.require(request, "write")

    @app.middleware("http")
    async def request_id(request: Request, call_next):
        rid = request.headers.get("x-request-id") or "req_" + uuid.uuid4().hex[:16]
        start = time.perf_counter()
        response = await call_next(request)
        response.headers["x-request-id"] = rid
        route = request.scope.get("route")
        path = getattr(route, "path", "unmatched")
        latency.labels(request.method, path, str(response.status_code)).observe(time.perf_counter() - start)
        return response

    # ---- open probes -----------------------------------------------------------------------------

    @app.get("/healthz", tags=["health"])
    def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/readyz", tags=["health"])
    def readyz() -> JSONResponse:
        ready = ray.is_initialized() and service.is_alive
        return JSONResponse({"status": "ready" if ready else "starting"}, 200 if ready else 503)

    # ---- service facts ---------------------------------------------------------------------------

    @app.get("/v1/version", dependencies=[Depends(reader)])
    def version() -> dict[str, Any]:
        import torch
        import transformers

        from engines.rollout import available_backends

        backends = available_backends()
        return {
            "service": VERSION,
            "ray": ray.__version__,
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "rollout_backends": {
                name: {"available": why is None, "reason": why} for name, why in backends.items()
            },
        }

    @app.get("/v1/cluster", dependencies=[Depends(reader)])
    def cluster() -> dict[str, Any]:
        return service.cluster()

    @app.get("/metrics", dependencies=[Depends(reader)], include_in_schema=False)
    def prometheus() -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    # ---- jobs ------------------------------------------------------------------------------------

    @app.post("/v1/jobs", status_code=201, dependencies=[Depends(writer)])
    def create_job(request: Request, response: Response, spec: JobSpec = Body(...)) -> dict[str, Any]:
        check_submittable(spec)
        key = request.headers.get("idempotency-key")
        body_hash = hashlib.sha256(
            json.dumps(spec.model_dump(mode="json"), sort_keys=True).encode()
        ).hexdigest()
        job, created = service.submit(spec, key, body_hash)
        if not created:
            response.status_code = 200
        return job_view(job)

    @app.get("/v1/jobs", dependencies=[Depends(reader)])
    def list_jobs(
        status: list[str] | None = Query(None, description="filter by status; repeatable"),
        metadata: list[str] | None = Query(None, description="filter by metadata, 'key:value'; repeatable"),
        after: str | None = Query(None, description="cursor: the last job id of the previous page"),
        limit: int = Query(20, ge=1, le=100),
    ) -> dict[str, Any]:
        filters: dict[str, str] = {}
        for item in metadata or []:
            key, sep, value = item.partition(":")
            if not sep:
                raise APIError(
                    422, f"metadata filter '{item}' must be 'key:value'", "metadata", "invalid_value"
                )
            filters[key] = value
        try:
            jobs, more = service.store.list_jobs(status, filters, after, limit)
        except KeyError:
            raise APIError(404, f"cursor job '{after}' does not exist", "after", "not_found") from None
        return listing([job_view(j) for j in jobs], more)

    @app.get("/v1/jobs/{job_id}", dependencies=[Depends(reader)])
    def get_job(job_id: str) -> dict[str, Any]:
        return job_view(service.get(job_id))

    @app.delete("/v1/jobs/{job_id}", dependencies=[Depends(writer)])
    def delete_job(job_id: str) -> dict[str, Any]:
        service.delete(job_id)
        return {"id": job_id, "object": "job", "deleted": True}

    @app.post("/v1/jobs/{job_id}/cancel", dependencies=[Depends(writer)])
    def cancel(job_id: str) -> dict[str, Any]:
        return job_view(service.cancel(job_id))

    @app.post("/v1/jobs/{job_id}/pause", dependencies=[Depends(writer)])
    def pause(job_id: str) -> dict[str, Any]:
        return job_view(service.pause(job_id))

    @app.post("/v1/jobs/{job_id}/resume", dependencies=[Depends(writer)])
    def resume(job_id: str) -> dict[str, Any]:
        return job_view(service.resume(job_id))

    @app.post("/v1/jobs/{job_id}/fork", status_code=201, dependencies=[Depends(writer)])
    def fork(job_id: str, body: ForkRequest = Body(default_factory=ForkRequest)) -> dict[str, Any]:
        return job_view(service.fork(job_id, body.checkpoint_step, body.overrides))

    @app.patch("/v1/jobs/{job_id}/hyperparameters", dependencies=[Depends(writer)])
    def hyperparameters(
        job_id: str, changes: dict[str, Any] = Body(..., examples=[{"lr": 1e-4}])
    ) -> dict[str, Any]:
        if not changes:
            raise APIError(422, "give at least one hyper-parameter to change", None, "empty_body")
        return job_view(service.set_hyperparameters(job_id, changes))

    # ---- what a job produced ------------------------------------------------------------------

    @app.get("/v1/jobs/{job_id}/events", dependencies=[Depends(reader)])
    def events(job_id: str, after: int = Query(0, ge=0), limit: int = Query(100, ge=1, le=1000)) -> dict:
        service.get(job_id)
        rows = service.store.events(job_id, after, limit + 1)
        return listing(rows[:limit], len(rows) > limit)

    @app.get("/v1/jobs/{job_id}/events/stream", dependencies=[Depends(reader)])
    def events_stream(request: Request, job_id: str, after: int = Query(0, ge=0)):
        service.get(job_id)
        return sse(request, service.store, job_id, lambda last: service.store.events(job_id, last, 200),
                   lambda row: row["kind"], start_id(request, after))  # fmt: skip

    @app.get("/v1/jobs/{job_id}/metrics", dependencies=[Depends(reader)])
    def metrics(
        job_id: str,
        keys: str | None = Query(None, description="comma-separated metric names"),
        step_min: int | None = Query(None, ge=0),
        step_max: int | None = Query(None, ge=0),
    ) -> dict[str, Any]:
        service.get(job_id)
        wanted = [k for k in (keys or "").split(",") if k] or None
        return listing(service.store.metrics(job_id, wanted, step_min, step_max), False)

    @app.get("/v1/jobs/{job_id}/metrics/stream", dependencies=[Depends(reader)])
    def metrics_stream(request: Request, job_id: str, after: int = Query(0, ge=0)):
        service.get(job_id)
        return sse(request, service.store, job_id, lambda last: service.store.metrics(job_id, after_id=last, limit=200),
                   lambda row: "metrics", start_id(request, after))  # fmt: skip

    @app.get("/v1/jobs/{job_id}/logs", dependencies=[Depends(reader)])
    def logs(job_id: str, tail: int = Query(200, ge=1, le=10_000)) -> dict[str, Any]:
        service.get(job_id)
        return listing(service.store.logs(job_id, tail=tail), False)

    @app.get("/v1/jobs/{job_id}/logs/stream", dependencies=[Depends(reader)])
    def logs_stream(request: Request, job_id: str, after: int = Query(0, ge=0)):
        service.get(job_id)
        return sse(request, service.store, job_id, lambda last: service.store.logs(job_id, after_id=last, limit=500),
                   lambda row: "log", start_id(request, after))  # fmt: skip

    @app.get("/v1/jobs/{job_id}/checkpoints", dependencies=[Depends(reader)])
    def checkpoints(job_id: str) -> dict[str, Any]:
        return listing(service.checkpoint_dirs(job_id), False)

    @app.post("/v1/jobs/{job_id}/checkpoints", status_code=202, dependencies=[Depends(writer)])
    def checkpoint_now(job_id: str) -> dict[str, Any]:
        service.checkpoint_now(job_id)
        return {"id": job_id, "object": "checkpoint_request", "status": "requested"}

    # ---- rewards -------------------------------------------------------------------------------

    @app.post("/v1/rewards/validate", dependencies=[Depends(writer)])
    def validate_reward(body: RewardValidateRequest) -> dict[str, Any]:
        try:
            scorer = RewardScorer(body.function)
        except RewardFunctionError as err:
            raise APIError(400, str(err), "function", "invalid_reward_function") from None
        rows = body.rows
        result = scorer.score([r.prompt for r in rows], [r.response for r in rows],
                              [r.ground_truth for r in rows], [r.extra for r in rows])  # fmt: skip
        return {
            "function": body.function,
            "scores": result.scores.tolist(),
            "metrics": result.metrics,
            "errors": result.errors,
            "error_messages": result.error_messages,
        }

    app.state.terminal_states = TERMINAL
    mount_dashboard(app)
    return app
