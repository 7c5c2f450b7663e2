"""The API's one error shape: {"error": {"message", "type", "param", "code"}}, with the field at fault.

Validation errors of a request body name the dotted field (`trainer.total_steps`), so a client can
point at it; service refusals carry their own status, param and code.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from controller.service import ServiceError

TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    409: "conflict_error",
    422: "invalid_request_error",
    503: "unavailable_error",
}


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:  # fmt: skip
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers


def error_body(
    status: int, message: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    return {
        "error": {"message": message, "type": TYPES.get(status, "api_error"), "param": param, "code": code}
    }


def _field(loc: tuple) -> str | None:
    parts = [str(p) for p in loc if p not in ("body", "query", "path", "header")]
    return ".".join(parts) or None


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, err: APIError) -> JSONResponse:
        return JSONResponse(
            error_body(err.status, err.message, err.param, err.code), err.status, headers=err.headers
        )

    @app.exception_handler(ServiceError)
    async def _service_error(request: Request, err: ServiceError) -> JSONResponse:
        return JSONResponse(error_body(err.status, str(err), err.param, err.code), err.status)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, err: RequestValidationError) -> JSONResponse:
        first = err.errors()[0] if err.errors() else {"loc": (), "msg": "invalid request"}
        param = _field(tuple(first.get("loc", ())))
        message = first.get("msg", "invalid request")
        if param:
            message = f"{param}: {message}"
        return JSONResponse(error_body(422, message, param, "invalid_value"), 422)

    @app.exception_handler(HTTPException)
    async def _http(request: Request, err: HTTPException) -> JSONResponse:
        return JSONResponse(
            error_body(err.status_code, str(err.detail)), err.status_code, headers=err.headers
        )
