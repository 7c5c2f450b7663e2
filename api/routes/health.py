"""Service facts: open liveness/readiness probes, versions, the cluster, Prometheus metrics."""

from __future__ import annotations

import os
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

import ray
from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel

from api.deps import ADMIN, AUTH_ERRORS, READ, CallerDep, ServiceDep

VERSION = "0.1.0"

router = APIRouter()


@router.get("/healthz", tags=["health"])
def healthz() -> dict[str, str]:
    return {"status": "ok"}


class Readiness(BaseModel):
    status: str


@router.get(
    "/readyz",
    tags=["health"],
    responses={503: {"model": Readiness, "description": "Ray or the scheduler is not up"}},
)
def readyz(service: ServiceDep) -> JSONResponse:
    ready = ray.is_initialized() and service.is_alive
    return JSONResponse({"status": "ready" if ready else "starting"}, 200 if ready else 503)


@router.get("/v1/version", dependencies=READ, responses=AUTH_ERRORS)
def version() -> dict[str, Any]:
    from engines.rollout import available_backends

    backends = available_backends()
    return {
        "service": VERSION,
        "ray": ray.__version__,
        # From the package metadata: the API process never imports the training stack.
        "torch": _installed_version("torch"),
        "transformers": _installed_version("transformers"),
        "rollout_backends": {
            name: {"available": why is None, "reason": why} for name, why in backends.items()
        },
    }


def _installed_version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


# Libraries that only job processes need: the API process reports whether it has loaded any of them.
HEAVY_MODULES = (
    "torch", "transformers", "vllm", "sglang", "tensordict", "peft", "workers.hybrid", "controller.job_actor",
)  # fmt: skip


@router.get("/v1/service", dependencies=ADMIN, responses=AUTH_ERRORS)
def service_process() -> dict[str, Any]:
    """The API process itself: its pid, resident memory, and which heavy libraries it has loaded."""
    rss = None
    status = Path(f"/proc/{os.getpid()}/status")
    if status.exists():
        for line in status.read_text().splitlines():
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1]) * 1024
    return {
        "pid": os.getpid(),
        "rss_bytes": rss,
        "modules": {name: name in sys.modules for name in HEAVY_MODULES},
    }


@router.get("/v1/cluster", dependencies=READ, responses=AUTH_ERRORS)
def cluster(service: ServiceDep, caller: CallerDep) -> dict[str, Any]:
    """The nodes, the CPUs and GPUs in all and free, and the jobs running and queued: the caller's
    own jobs (an admin's: everyone's); node addresses for an admin only."""
    return service.cluster(caller.sees)


@router.get("/metrics", dependencies=READ, include_in_schema=False)
def prometheus(request: Request) -> Response:
    return Response(generate_latest(request.app.state.registry), media_type=CONTENT_TYPE_LATEST)
