"""From an API request to the job's endpoint actor (controller/external.py), torch-free: the checks the
job's record allows here, then the call, awaited on the event loop; error answers come back as data
and are raised in the API's error shape.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import ray

from api.errors import APIError
from schema.external import server_name
from service.service import Service

REQUEST_TIMEOUT_S = 900.0  # a call may wait for a training step's update on a colocated worker
LOOKUP_TIMEOUT_S = 10.0  # finding the job's endpoint actor by name (a GCS call)
STARTING_WAIT_S = 120.0  # a running job's first calls wait this long for its endpoint actor
STARTING_POLL_S = 0.5
_servers: dict[str, Any] = {}  # job id -> actor handle, for this API process


def external_job(service: Service, job_id: str, sees: str | None) -> Any:
    """The job's record when it can serve calls: 404 unknown, 409 not fed externally or not running."""
    job = service.get(job_id, sees)
    if (job.spec.get("rollout") or {}).get("source") != "external":
        raise APIError(409, f"job '{job_id}' is not fed externally: submit it with rollout.source: external",
                       "job_id", "not_external")  # fmt: skip
    if job.status != "running":
        raise APIError(409, f"job '{job_id}' is {job.status}: its endpoint serves only while it runs",
                       "job_id", "not_running")  # fmt: skip
    return job


def model_names(job: Any) -> list[str]:
    """What `model` may say: the job's id (listed by /models), its name, or its model's builtin/path/hub id."""
    model = job.spec.get("model") or {}
    names = [job.id, job.name, model.get("builtin"), model.get("path"), model.get("hf_id")]
    return [n for n in names if n]


def check_model(job: Any, model: str) -> None:
    if model not in model_names(job):
        raise APIError(404, f"model '{model}' is not served here; this endpoint serves '{job.id}'",
                       "model", "model_not_found")  # fmt: skip


async def _find_server(job_id: str) -> Any:
    """The job's endpoint actor; a job's first calls wait for it rather than answer 503, so that a client
    with default retries reaches a job that has just started."""
    deadline = time.monotonic() + STARTING_WAIT_S
    while True:
        try:
            lookup = asyncio.to_thread(ray.get_actor, server_name(job_id))
            server = await asyncio.wait_for(lookup, LOOKUP_TIMEOUT_S)
            break
        except ValueError:
            if time.monotonic() >= deadline:
                raise APIError(503, f"job '{job_id}' is starting: its endpoint did not come up within "
                               f"{STARTING_WAIT_S:.0f} s", None, "endpoint_starting", {"Retry-After": "2"}) from None  # fmt: skip
            await asyncio.sleep(STARTING_POLL_S)
        except asyncio.TimeoutError:
            raise APIError(503, f"job '{job_id}''s endpoint actor {server_name(job_id)} was not found within "
                           f"{LOOKUP_TIMEOUT_S:.0f} s (Ray's control store did not answer)", None,
                           "endpoint_unavailable", {"Retry-After": "2"}) from None  # fmt: skip
    _servers[job_id] = server
    return server


async def call(job_id: str, method: str, *args: Any) -> dict[str, Any]:
    """`ExternalServer.<method>(*args)` of the job, its error answer raised as an APIError."""
    server = _servers.get(job_id) or await _find_server(job_id)
    try:
        out = await asyncio.wait_for(getattr(server, method).remote(*args), REQUEST_TIMEOUT_S)
    except (ray.exceptions.RayActorError, asyncio.TimeoutError) as err:
        _servers.pop(job_id, None)
        raise APIError(503, f"job '{job_id}''s endpoint did not answer: {type(err).__name__}", None,
                       "endpoint_unavailable", {"Retry-After": "2"}) from None  # fmt: skip
    e = out.get("error") if isinstance(out, dict) else None
    if not isinstance(e, dict) or "status" not in e:
        return out
    retry = {"Retry-After": str(max(1, round(e.get("retry_after") or 1)))}
    raise APIError(
        e["status"], e["message"], e.get("param"), e.get("code"), retry if e["status"] in (429, 503) else None
    )
