"""Jobs: submit (with Idempotency-Key), list, read, delete, and steer them."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from typing import Any

from fastapi import APIRouter, Body, Query, Request, Response
from pydantic import BaseModel, ConfigDict, Field

from api.body_checks import CheckedRoute
from api.deps import (
    AUTH_ERRORS,
    BODY_ERRORS,
    INT64_MAX,
    READ,
    WRITE,
    CallerDep,
    CheckerDep,
    HotReadsDep,
    OwnerQuery,
    ServiceDep,
)
from api.errors import APIError, documented, invalid
from api.settings import ServeSettings
from api.views import EncodedSummary, job_view, listing_json
from schema.job import METADATA_KEY, JobSpec
from service.job_state import JobStatus

router = APIRouter(
    prefix="/v1/jobs", tags=["jobs"], route_class=CheckedRoute, responses={**AUTH_ERRORS, **documented(404)}
)
IDEMPOTENCY_KEY_MAX_CHARS = 255


class ForkRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    checkpoint_step: int | None = Field(
        None, ge=0, le=INT64_MAX, description="the parent's checkpoint to start from; None = latest"
    )
    overrides: dict[str, Any] = Field(default_factory=dict, description="JobSpec fields to change, nested")


@router.post("", status_code=201, dependencies=WRITE, responses={**BODY_ERRORS, **documented(409, 429)})
def create_job(
    request: Request,
    response: Response,
    service: ServiceDep,
    checker: CheckerDep,
    caller: CallerDep,
    spec: JobSpec = Body(...),
) -> dict[str, Any]:
    """Queue a job; it belongs to the key's owner. Uploaded files it names must be the owner's."""
    checker.submittable(spec, caller.sees)
    key = request.headers.get("idempotency-key")
    if key is not None and len(key) > IDEMPOTENCY_KEY_MAX_CHARS:
        why = f"{len(key)} characters; at most {IDEMPOTENCY_KEY_MAX_CHARS} are allowed"
        raise invalid("Idempotency-Key", why, "too_long")
    body_hash = hashlib.sha256(json.dumps(spec.model_dump(mode="json"), sort_keys=True).encode()).hexdigest()
    job, created = service.submit(spec, key, body_hash, owner=caller.owner)
    if not created:
        response.status_code = 200
    return job_view(job)


@router.post("/validate", dependencies=WRITE, responses=BODY_ERRORS)
def validate_job(
    service: ServiceDep, checker: CheckerDep, caller: CallerDep, spec: JobSpec = Body(...)
) -> dict[str, Any]:
    """The checks of `POST /v1/jobs`, without creating a job (`tandem submit --dry-run`)."""
    checker.submittable(spec, caller.sees)
    service.check_fits_cluster(spec)
    return {"object": "job_spec", "valid": True, "spec": spec.model_dump(mode="json")}


@router.get("", dependencies=READ, response_model=dict[str, Any])
async def list_jobs(
    request: Request,
    service: ServiceDep,
    hot: HotReadsDep,
    caller: CallerDep,
    checker: CheckerDep,
    owner: OwnerQuery = None,
    status: list[JobStatus] | None = Query(None, description="filter by status; repeatable"),
    metadata: list[str] | None = Query(None, description="filter by metadata, 'key:value'; repeatable"),
    after: str | None = Query(None, description="cursor: the last job id of the previous page"),
    limit: int = Query(20, ge=1, le=100),
    q: str | None = Query(None, max_length=200, description="substring of the id, name, tags or notes"),
    tag: str | None = Query(None, max_length=64, description="only jobs with this tag"),
) -> Response:
    """Newest first, as summaries without the spec (GET /v1/jobs/{id} has it): the caller's own jobs
    (an admin's: everyone's, or `owner`'s)."""
    filters = metadata_filters(metadata or [], checker.settings)
    owner = caller.viewing(owner)

    def read() -> tuple[list[EncodedSummary], bool]:
        try:
            jobs, more = service.store.list_jobs(status, filters, after, limit, q=q, tag=tag, owner=owner)
        except KeyError:
            raise APIError(404, f"cursor job '{after}' does not exist", "after", "not_found") from None
        return [EncodedSummary.of(j) for j in jobs], more

    page = ("jobs", tuple(status or ()), tuple(filters.items()), after, limit, q, tag, owner)
    return await hot.answer(request, page, "jobs", read, render_page)


def metadata_filters(items: list[str], settings: ServeSettings) -> dict[str, str]:
    """`key:value` filters as {key: value}; a key or value no job's metadata could hold is a 422."""
    if len(items) > settings.metadata_max_keys:
        why = f"{len(items)} filters; a job has at most {settings.metadata_max_keys} metadata keys"
        raise invalid("metadata", why, "too_many_keys")
    filters: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition(":")
        if not sep:
            raise APIError(
                422, f"metadata filter '{item[:64]}' must be 'key:value'", "metadata", "invalid_value"
            )
        if not METADATA_KEY.fullmatch(key):
            raise APIError(422, f"metadata filter '{item[:64]}': a key is letters, digits and _ . - /, not "
                           "starting with . - /", "metadata", "invalid_value")  # fmt: skip
        most_key, most_value = settings.metadata_max_key_chars, settings.metadata_max_value_chars
        if len(key) > most_key or len(value) > most_value:
            raise APIError(422, f"metadata filter '{item[:64]}...': a key holds at most {most_key} characters, a "
                           f"value {most_value}", "metadata", "too_long")  # fmt: skip
        filters[key] = value
    return filters


def render_page(page: tuple[list[EncodedSummary], bool]) -> bytes:
    """A cached list page as sent: each summary with its live fields."""
    summaries, more = page
    return listing_json([s.json() for s in summaries], more)


@router.get("/{job_id}", dependencies=READ)
def get_job(job_id: str, service: ServiceDep, caller: CallerDep) -> dict[str, Any]:
    return job_view(service.get(job_id, caller.sees))


class LabelsPatch(BaseModel):
    """The fields to change; those left out keep their value."""

    model_config = ConfigDict(extra="forbid")
    name: str | None = Field(None, description="a short human name; null clears it")
    tags: list[str] = Field(default_factory=list, description="the whole new list of tags")
    notes: str = Field("", description="free text")


@router.patch("/{job_id}", dependencies=WRITE, responses=BODY_ERRORS)
def update_job(
    job_id: str, service: ServiceDep, caller: CallerDep, body: LabelsPatch = Body(...)
) -> dict[str, Any]:
    """Change a job's name, tags or notes, in any status."""
    changes = body.model_dump(exclude_unset=True)
    if not changes:
        raise APIError(422, "give at least one of name, tags, notes", None, "empty_body")
    return job_view(service.update_labels(job_id, changes, caller.sees))


@router.delete("/{job_id}", dependencies=WRITE, responses=documented(409))
def delete_job(job_id: str, service: ServiceDep, caller: CallerDep) -> dict[str, Any]:
    owner = service.get(job_id, caller.sees).owner
    service.delete(job_id, caller.sees)
    return {"id": job_id, "object": "job", "deleted": True, "owner": owner}


def _steer(action: str) -> Callable[..., dict[str, Any]]:
    def steer(job_id: str, service: ServiceDep, caller: CallerDep) -> dict[str, Any]:
        return job_view(getattr(service, action)(job_id, caller.sees))

    return steer


for _action, _refusals in (("cancel", (409,)), ("pause", (409,)), ("resume", (409, 429))):
    router.post(f"/{{job_id}}/{_action}", name=_action, dependencies=WRITE, responses=documented(*_refusals))(
        _steer(_action)
    )


@router.post(
    "/{job_id}/fork", status_code=201, dependencies=WRITE, responses={**BODY_ERRORS, **documented(409, 429)}
)
def fork(
    job_id: str,
    service: ServiceDep,
    checker: CheckerDep,
    caller: CallerDep,
    body: ForkRequest = Body(default_factory=ForkRequest),
) -> dict[str, Any]:
    """A new job of the caller's own from a checkpoint of a job it can see."""
    spec = service.merged_spec(job_id, body.overrides, caller.sees)
    # The fork resumes from its own copy of the parent's checkpoint, whatever resume_from said.
    checker.submittable(spec.merged({"checkpoint": {"resume_from": None}}), caller.sees)
    return job_view(service.fork(job_id, body.checkpoint_step, spec, caller.owner))


@router.patch("/{job_id}/hyperparameters", dependencies=WRITE, responses={**BODY_ERRORS, **documented(409)})
def hyperparameters(
    job_id: str,
    service: ServiceDep,
    caller: CallerDep,
    changes: dict[str, Any] = Body(..., examples=[{"lr": 1e-4}]),
) -> dict[str, Any]:
    if not changes:
        raise APIError(422, "give at least one hyper-parameter to change", None, "empty_body")
    return job_view(service.set_hyperparameters(job_id, changes, caller.sees))
