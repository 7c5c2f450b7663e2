"""The API's one error shape: {"error": {"message", "type", "param", "code"}}, naming the dotted field at
fault. Under /api/v1 (the Tinker SDK's protocol) the same refusals answer in the SDK's shape,
`{"error": str, "category", "param"}`. An error no handler expected is a 500 naming the request id.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

from schema.section import error_message
from service.errors import ServiceError

# status -> (the error's type, what it means as the OpenAPI document says)
STATUSES = {
    400: ("invalid_request_error", "The request could not be read"),
    401: ("authentication_error", "No bearer token, or an unknown one"),
    403: (
        "permission_error",
        "The key lacks the scope this route needs, or a hard quota of its owner is reached",
    ),
    404: ("not_found_error", "No such resource"),
    405: ("invalid_request_error", None),
    408: ("timeout_error", "The request body paused too long before it was complete"),
    409: ("conflict_error", "The resource is in a state that does not allow this"),
    413: ("request_too_large", "The request body is larger than the service accepts"),
    415: ("invalid_request_error", "A JSON body sent without `Content-Type: application/json`"),
    422: ("invalid_request_error", "A field is invalid; `error.param` names it (dotted)"),
    429: (
        "rate_limit_error",
        "A quota of the owner is reached for now (`error.param` names it); Retry-After says when to retry",
    ),
    500: ("server_error", None),
    503: ("unavailable_error", "The service is not ready"),
}
TINKER_PREFIX = "/api/v1/"
log = logging.getLogger("tandem.api")


class ErrorDetail(BaseModel):
    message: str = Field(..., description="what is wrong and what to do")
    type: str = Field(..., description="the error's class, e.g. invalid_request_error")
    param: str | None = Field(None, description="the dotted field at fault, e.g. trainer.total_steps")
    code: str | None = Field(None, description="a stable machine-readable code, e.g. invalid_value")


class ErrorResponse(BaseModel):
    error: ErrorDetail


def documented(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI `responses` for these statuses, each with the real error schema."""
    return {status: {"model": ErrorResponse, "description": STATUSES[status][1]} for status in statuses}


class APIError(ServiceError):
    """A ServiceError written status first, as the routes raise it."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:  # fmt: skip
        super().__init__(message, status, param, code, headers)


def invalid(param: str, why: str, code: str = "invalid_value", status: int = 422) -> APIError:
    """A refusal whose message starts with the field at fault, as every validation message does."""
    return APIError(status, f"{param}: {why}", param, code)


def media_type(content_type: str | None) -> str:
    return (content_type or "").split(";")[0].strip().lower()


def is_json_media(content_type: str) -> bool:
    media = media_type(content_type)
    return media == "application/json" or media.endswith("+json")


def error_json(
    path: str, status: int, message: str, param: str | None, code: str | None
) -> tuple[int, dict[str, Any]]:
    """(status, body) of an error in the shape of its path: the SDK's `RequestFailedResponse` and the field
    at fault under /api/v1, the API's elsewhere. A Tinker refusal is a 400, never a 422: the SDK shows a
    4xx at once."""
    if path.startswith(TINKER_PREFIX):
        status = 400 if status == 422 else status
        return status, {"error": message, "category": "server" if status >= 500 else "user", "param": param}
    kind = STATUSES.get(status, ("api_error",))[0]
    return status, {"error": {"message": message, "type": kind, "param": param, "code": code}}


def shaped(request: Request, status: int, message: str, param: str | None, code: str | None,
           headers: dict[str, str] | None = None) -> JSONResponse:  # fmt: skip
    status, body = error_json(request.url.path, status, message, param, code)
    return JSONResponse(body, status, headers=headers)


def _field(loc: tuple) -> str | None:
    if len(loc) > 1 and loc[0] in ("query", "path", "header"):
        return str(loc[1])  # a repeated query parameter is named, not its index
    # Only the first element says where the field is: a field may be called "path" (model.path).
    parts = [str(p) for p in (loc[1:] if loc and loc[0] == "body" else loc)]
    return ".".join(parts) or None


def validation_refusal(request: Request, first: dict[str, Any]) -> tuple[int, str, str | None, str]:
    """(status, message, param, code) of a request's first validation error. A JSON body sent as something
    else (curl's `-d` alone sends a form) is a 415 that says so: FastAPI validates the raw bytes then."""
    kind, loc = request.headers.get("content-type"), tuple(first.get("loc", ()))
    # FastAPI reads a body sent without a Content-Type as bytes too (Python's requests with data=)
    sent = first.get("type") != "missing"
    if sent and loc and loc[0] == "body" and not is_json_media(kind or ""):
        header = "`Content-Type: application/json`"
        given = f"this request's Content-Type is '{media_type(kind)}'" if kind else "this request has none"
        why = f"send it with the header {header} ({given})"
        return 415, f"body: this route reads a JSON body; {why}", "body", "unsupported_media_type"
    if first.get("type") == "json_invalid":  # loc is ("body", character offset): the body is at fault
        why = (first.get("ctx") or {}).get("error", "invalid JSON")
        return 422, f"body: the request body is not valid JSON ({why})", "body", "invalid_json"
    param = _field(loc)
    code = "invalid_json" if param == "body" else "invalid_value"
    return 422, error_message(first.get("msg", "invalid request"), param), param, code


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ServiceError)  # an APIError, a refused file, path, tracker or quota too
    async def _refused(request: Request, err: ServiceError) -> JSONResponse:
        return shaped(request, err.status, err.message, err.param, err.code, err.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, err: RequestValidationError) -> JSONResponse:
        first = err.errors()[0] if err.errors() else {"loc": (), "msg": "invalid request"}
        return shaped(request, *validation_refusal(request, first))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, err: StarletteHTTPException) -> JSONResponse:
        code = {404: "unknown_route", 405: "method_not_allowed"}.get(err.status_code)
        message = str(err.detail)
        if err.status_code == 404 and message == "Not Found":
            message = f"no route {request.url.path}; see /docs for the API"
        elif err.status_code == 405:
            message = f"{request.method} is not allowed on {request.url.path}"
        param, code = getattr(err, "param", None), getattr(err, "code", code)
        return shaped(request, err.status_code, message, param, code, getattr(err, "headers", None))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, err: Exception) -> JSONResponse:
        # Starlette runs this outside the middleware that tags responses, so the id is added here.
        rid = request.scope.get("state", {}).get("request_id", "unknown")
        log.error("request %s %s %s failed: %s: %s", rid, request.method, request.url.path,
                  type(err).__name__, err, exc_info=err)  # fmt: skip
        message = (f"the service failed on this request ({type(err).__name__}); request id {rid} names it in "
                   "the service's log")  # fmt: skip
        return shaped(request, 500, message, None, "internal_error", {"x-request-id": rid})
