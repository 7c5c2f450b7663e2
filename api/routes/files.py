"""Files: upload data (JSONL, JSON, Parquet) and Python modules, list, read, delete them.

An upload is a form with one file field, `file`, or the raw request body with the file's name as a
query parameter; both stream to disk within the upload size limit:

    curl -H "Authorization: Bearer $TOKEN" -F file=@train.jsonl "$URL/v1/files"
    curl -H "Authorization: Bearer $TOKEN" --data-binary @train.jsonl \\
         -H 'Content-Type: application/octet-stream' "$URL/v1/files?filename=train.jsonl"

A spec then names it by id (`data.train_path: "file-0123456789ab"`, `reward.function:
"file-0123456789ab:score"`); see service/files.py.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from fastapi import APIRouter, Query, Request

from api.deps import AUTH_ERRORS, BODY_ERRORS, READ, WRITE, CallerDep, OwnerQuery, ServiceDep
from api.errors import APIError, documented
from api.multipart_upload import FIELD, is_multipart, multipart_file
from api.views import listing
from service.files import FileError, check_filename
from service.service import ServiceError

router = APIRouter(prefix="/v1/files", tags=["files"], responses={**AUTH_ERRORS, **documented(404)})

UPLOAD_BODY = {
    "requestBody": {
        "required": True,
        "content": {
            "application/octet-stream": {"schema": {"type": "string", "format": "binary"}},
            "multipart/form-data": {
                "schema": {
                    "type": "object",
                    "properties": {FIELD: {"type": "string", "format": "binary"}},
                    "required": [FIELD],
                }
            },
        },
    }
}


@router.post("", status_code=201, dependencies=WRITE, responses=BODY_ERRORS, openapi_extra=UPLOAD_BODY)
async def upload(
    request: Request,
    service: ServiceDep,
    caller: CallerDep,
    filename: str | None = Query(
        None,
        max_length=128,
        description="the file's name, its suffix says what it is (a form: its file's name)",
    ),
) -> dict[str, Any]:
    if is_multipart(request):
        sent_as, chunks = await multipart_file(request)
        name, field = filename or sent_as, FIELD
    elif filename is None:
        raise APIError(422, "filename: give the file's name, ?filename=train.jsonl, or send a form "
                       f"(curl -F {FIELD}=@train.jsonl)", "filename", "invalid_value")  # fmt: skip
    else:
        name, field, chunks = filename, "body", request.stream()
    check_filename(name)
    service.check_storage(caller.owner, adding=1)  # an owner at its stored bytes can add nothing
    try:
        record = await service.files.save(name, chunks, caller.owner)
    except FileError as err:
        if err.param != "body" or field == "body":
            raise
        raise FileError(str(err).replace("body:", f"{field}:", 1), field) from None
    try:
        service.check_storage(caller.owner)
    except ServiceError:  # past the owner's stored bytes with this file: it is not kept
        service.files.delete(record.id)
        raise
    return asdict(record)


@router.get("", dependencies=READ)
def list_files(service: ServiceDep, caller: CallerDep, owner: OwnerQuery = None) -> dict[str, Any]:
    """The caller's own uploads (an admin's: everyone's, or `owner`'s), newest first."""
    return listing([asdict(r) for r in service.files.records(caller.viewing(owner))], False)


@router.get("/{file_id}", dependencies=READ)
def get_file(file_id: str, service: ServiceDep, caller: CallerDep) -> dict[str, Any]:
    return asdict(service.files.get(file_id, caller.sees))


@router.delete("/{file_id}", dependencies=WRITE)
def delete_file(file_id: str, service: ServiceDep, caller: CallerDep) -> dict[str, Any]:
    owner = service.files.get(file_id, caller.sees).owner
    service.files.delete(file_id, caller.sees)
    return {"id": file_id, "object": "file", "deleted": True, "owner": owner}
