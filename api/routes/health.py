"""Service facts: open liveness/readiness probes, versions, the cluster, and Prometheus metrics (job
states and per-job progress read from the store at scrape time, the API's request latency)."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from importlib import metadata
from pathlib import Path
from typing import Any

import ray
from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector
from pydantic import BaseModel

from api.deps import ADMIN, AUTH_ERRORS, READ, CallerDep, ServiceDep
from service.store import ACTIVE, JobStatus, JobStore

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
    "torch", "transformers", "vllm", "sglang", "tensordict", "peft", "workers.actor_role", "controller.job_actor",
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
def prometheus(request: Request, service: ServiceDep, caller: CallerDep) -> Response:
    """An admin scrapes everything; any other key only its own jobs (not the service's traffic either)."""
    registry = request.app.state.registry
    if not caller.admin:
        registry = CollectorRegistry()
        registry.register(StoreCollector(service.store, caller.owner))
    return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)


PER_JOB = {
    "tandem_job_step": ("step", "current step of an active job"),
    "tandem_job_step_seconds": ("timing_s/step", "seconds of the job's latest step"),
    "tandem_job_reward": ("critic/score/mean", "mean training reward of the job's latest step"),
    "tandem_job_weight_sync_seconds": ("weight_sync/seconds", "seconds of the job's latest weight sync"),
}


class StoreCollector(Collector):
    """Job states and per-job gauges of every owner's jobs, or of `owner`'s only."""

    def __init__(self, store: JobStore, owner: str | None = None) -> None:
        self.store, self.owner = store, owner

    def collect(self) -> Iterator[GaugeMetricFamily]:
        counts = self.store.counts_by_status(self.owner)
        jobs = GaugeMetricFamily("tandem_jobs", "jobs by state", labels=["state"])
        for state in JobStatus:
            jobs.add_metric([state], counts.get(state, 0))
        yield jobs
        active = [j for j in self.store.jobs_in(ACTIVE) if self.owner in (None, j.owner)]
        for name, (key, doc) in PER_JOB.items():
            family = GaugeMetricFamily(name, doc, labels=["job"])
            for job in active:
                value = job.step if key == "step" else job.latest_metrics.get(key)
                if value is not None:
                    family.add_metric([job.id], float(value))
            yield family


def make_registry(store: JobStore) -> tuple[CollectorRegistry, Histogram]:
    registry = CollectorRegistry()
    registry.register(StoreCollector(store))
    latency = Histogram(
        "tandem_request_seconds", "API request latency", ["method", "route", "status"], registry=registry
    )
    return registry, latency
