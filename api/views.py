"""How stored records look on the wire: a job, and the list envelope every collection uses."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from fastapi import Response

from controller.store import JobRecord


def job_view(job: JobRecord) -> dict[str, Any]:
    """A job with its full spec (GET one, and what every write returns)."""
    return {**job_summary(job), "spec": job.spec}


def job_summary(job: JobRecord) -> dict[str, Any]:
    """A job as a list shows it: everything but the spec (fetch one job for that).

    `started_at` is the first start (a resume does not move it); `active_seconds` the time spent
    running over every run, still counting while it runs."""
    spec = job.spec
    model = spec["model"].get("builtin") or spec["model"].get("path")
    return {
        "id": job.id,
        "object": "job",
        "name": job.name,
        "tags": job.tags,
        "notes": job.notes,
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
        "active_seconds": job.active_seconds(),
        "outputs": _outputs(job),
    }


def _outputs(job: JobRecord) -> dict[str, str | None]:
    """Where the job writes on the server: its folder, and the HF export once it exists."""
    export = Path(job.workdir) / "export"
    return {"workdir": job.workdir, "export": str(export) if (export / "config.json").exists() else None}


def listing(data: list[Any], has_more: bool) -> dict[str, Any]:
    return {"object": "list", "data": data, "has_more": has_more}


def json_listing(data: list[Any], has_more: bool) -> Response:
    """The list envelope, encoded once with json.dumps: for the routes a dashboard polls. FastAPI's
    own path (validate the dict, walk it, encode it) costs about ten times more on a 200-row page."""
    return Response(json.dumps(listing(data, has_more)), media_type="application/json")
