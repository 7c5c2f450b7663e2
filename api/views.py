"""How stored records look on the wire: a job, and the list envelope every collection uses."""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

from fastapi import Response

from service.store import JobRecord


def job_view(job: JobRecord) -> dict[str, Any]:
    """A job with its full spec (GET one, and what every write returns)."""
    return {**job_summary(job), "spec": job.spec}


def job_summary(job: JobRecord) -> dict[str, Any]:
    """A job as a list shows it: everything but the spec."""
    return {**stored_summary(job), **live_summary(job)}


def stored_summary(job: JobRecord) -> dict[str, Any]:
    """The summary's fields that change only when the job's row does."""
    spec = job.spec
    model = spec["model"].get("builtin") or spec["model"].get("path")
    return {
        "id": job.id,
        "object": "job",
        "owner": job.owner,
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
        "restart": job.restart,  # while a lost worker is being replaced: {"message": "restarting (1/3): ...", ...}
        "parent_id": job.parent_id,
        "metadata": job.metadata,
        "lora": _lora(spec["model"].get("lora"), job.latest_metrics),
    }


def _lora(lora: dict[str, Any] | None, latest: dict[str, float]) -> dict[str, Any] | None:
    """A LoRA job's adapter: its shape from the spec, its size from the last adapter sync's metrics."""
    if lora is None:
        return None
    trainable = latest.get("lora/trainable_params")
    size = latest.get("weight_sync/bytes")
    return {
        "rank": lora["rank"],
        "alpha": lora["alpha"],
        "target_modules": lora["target_modules"],
        "trainable_parameters": int(trainable) if trainable is not None else None,
        "adapter_bytes": int(size) if size is not None else None,
    }


def live_summary(job: JobRecord) -> dict[str, Any]:
    """The summary's fields that change without a write: the running time, the export on disk."""
    return {"active_seconds": job.active_seconds(), "outputs": _outputs(job)}


def _outputs(job: JobRecord) -> dict[str, str | None]:
    """Where the job writes on the server: its folder, and the HF export once it exists."""
    export = os.path.join(job.workdir, "export")  # os.path: cheaper than pathlib, per job per list
    done = os.path.exists(export + "/config.json") or os.path.exists(export + "/adapter_config.json")
    return {"workdir": job.workdir, "export": export if done else None}


@dataclasses.dataclass(frozen=True)
class EncodedSummary:
    """A job's summary with its stored fields encoded once: `json()` adds the live ones when sent."""

    head: str  # the stored fields as a JSON object, without its closing brace
    job: JobRecord  # the record without its spec: what the live fields are computed from

    @classmethod
    def of(cls, job: JobRecord) -> EncodedSummary:
        return cls(json.dumps(stored_summary(job))[:-1], dataclasses.replace(job, spec={}))

    def json(self) -> str:
        """json.dumps(job_summary(job)), byte for byte."""
        return self.head + ", " + json.dumps(live_summary(self.job))[1:]


def listing(data: list[Any], has_more: bool) -> dict[str, Any]:
    return {"object": "list", "data": data, "has_more": has_more}


def listing_json(rows: list[str], has_more: bool) -> bytes:
    """json.dumps(listing(...)) of rows that are JSON text already, byte for byte."""
    return f'{{"object": "list", "data": [{", ".join(rows)}], "has_more": {json.dumps(has_more)}}}'.encode()


def json_response(body: bytes) -> Response:
    """An encoded JSON body, sent as is: FastAPI would validate, walk and encode the dict again."""
    return Response(body, media_type="application/json")
