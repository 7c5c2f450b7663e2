"""Files: upload data (JSONL, JSON, Parquet) and Python modules, list, read, delete them.

An upload is the raw request body with the file's name as a query parameter, so it streams to disk
within the upload size limit and needs no multipart parser:

    curl -H "Authorization: Bearer $TOKEN" --data-binary @train.jsonl \\
         -H 'Content-Type: application/octet-stream' "$URL/v1/files?filename=train.jsonl"

A spec then names it by id (`data.train_path: "file-0123456789ab"`, `reward.function:
"file-0123456789ab:score"`); see controller/files.py.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from fastapi import APIRouter, Query, Request

from api.deps import AUTH_ERRORS, BODY_ERRORS, READ, WRITE, ServiceDep
from api.errors import documented
from api.views import listing
from controller.files import check_filename

router = APIRouter(prefix="/v1/files", tags=["files"], responses={**AUTH_ERRORS, **documented(404)})

UPLOAD_BODY = {
    "requestBody": {
        "required": True,
        "content": {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}},
    }
}


@router.post("", status_code=201, dependencies=WRITE, responses=BODY_ERRORS, openapi_extra=UPLOAD_BODY)
async def upload(
    request: Request,
    service: ServiceDep,
    filename: str = Query(..., max_length=128, description="the file's name; its suffix says what it is"),
) -> dict[str, Any]:
    check_filename(filename)
    return asdict(await service.files.save(filename, request.stream()))


@router.get("", dependencies=READ)
def list_files(service: ServiceDep) -> dict[str, Any]:
    return listing([asdict(r) for r in service.files.records()], False)


@router.get("/{file_id}", dependencies=READ)
def get_file(file_id: str, service: ServiceDep) -> dict[str, Any]:
    return asdict(service.files.get(file_id))


@router.delete("/{file_id}", dependencies=WRITE)
def delete_file(file_id: str, service: ServiceDep) -> dict[str, Any]:
    service.files.delete(file_id)
    return {"id": file_id, "object": "file", "deleted": True}
