"""How stored records look on the wire: a job, and the list envelope every collection uses."""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

from fastapi import Response

from service.store import JobRecord

# A summary's fields in order: the record's, and those `stored_summary` computes. `restart` is set while
# a lost worker is being replaced: {"message": "restarting (1/3): ...", ...}.
SUMMARY_FIELDS = (
    "id object owner name tags notes status method model created_at started_at finished_at step total_steps "
    "progress latest_metrics error restart parent_id metadata lora"
).split()


def job_view(job: JobRecord) -> dict[str, Any]:
    """A job with its full spec (GET one, and what every write returns)."""
    return {**job_summary(job), "spec": job.spec}


def job_summary(job: JobRecord) -> dict[str, Any]:
    """A job as a list shows it: everything but the spec."""
    return {**stored_summary(job), **live_summary(job)}


def stored_summary(job: JobRecord) -> dict[str, Any]:
    """The summary's fields that change only when the job's row does."""
    model = job.spec["model"]
    computed = {
        "object": "job",
        "model": model.get("builtin") or model.get("path"),
        "progress": job.step / job.total_steps if job.total_steps else 0.0,
        "lora": _lora(model.get("lora"), job.latest_metrics),
    }
    return {name: computed[name] if name in computed else getattr(job, name) for name in SUMMARY_FIELDS}


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
