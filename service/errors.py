"""The requests the service refuses, as the API answers them: an HTTP status and the field at fault.
Every refusal (a bad file reference, a path or tracker the owner may not name, a quota) is a
ServiceError, so one handler answers them all."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pydantic import ValidationError

from schema.section import error_message

if TYPE_CHECKING:
    from service.store import JobRecord


class ServiceError(Exception):
    """A request the service refuses: `status` is the HTTP status, `param` the field at fault."""

    def __init__(self, message: str, status: int = 400, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:  # fmt: skip
        super().__init__(message)
        self.message, self.status, self.param, self.code, self.headers = message, status, param, code, headers


def first_error(err: ValidationError) -> tuple[str, str | None]:
    """(message, dotted field) of a validation's first error, the way the API names a field."""
    first = err.errors()[0]
    param = ".".join(str(p) for p in first.get("loc", ())) or None
    return error_message(first.get("msg", "invalid value"), param), param


def invalid_value(err: ValidationError) -> ServiceError:
    """A 422 naming the first field at fault."""
    message, param = first_error(err)
    return ServiceError(message, 422, param, "invalid_value")


def invalid_state(job: JobRecord, why: str) -> ServiceError:
    return ServiceError(f"job '{job.id}' is {job.status}: {why}", 409, "job_id", "invalid_state")
