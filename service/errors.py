"""The requests the service refuses, as the API answers them: an HTTP status and the field at fault."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pydantic import ValidationError

from schema.section import error_message
from service.quotas import QuotaError

if TYPE_CHECKING:
    from service.store import JobRecord


class ServiceError(Exception):
    """A request the service refuses: `status` is the HTTP status, `param` the field at fault."""

    def __init__(self, message: str, status: int = 400, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:  # fmt: skip
        super().__init__(message)
        self.status, self.param, self.code, self.headers = status, param, code, headers


def quota_refusal(err: QuotaError) -> ServiceError:
    """A QuotaError as the API says it: 429 with Retry-After, or 403, naming the quota."""
    headers = {"Retry-After": str(err.retry_after_s)} if err.retry_after_s else None
    return ServiceError(str(err), err.status, f"quota.{err.name}", "quota_exceeded", headers)


def invalid_value(err: ValidationError) -> ServiceError:
    """A 422 naming the first field at fault."""
    first = err.errors()[0]
    param = ".".join(str(p) for p in first["loc"]) or None
    return ServiceError(error_message(first["msg"], param), 422, param, "invalid_value")


def invalid_state(job: JobRecord, why: str) -> ServiceError:
    return ServiceError(f"job '{job.id}' is {job.status}: {why}", 409, "job_id", "invalid_state")
