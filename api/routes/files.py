"""Files: upload data, Python modules and adapters, list, read, delete them. Specs name an upload by id.

An upload is a form with one file field, `file` (`curl -F file=@train.jsonl`), or the raw body with
`?filename=`. Both stream to disk as they arrive, never held whole in memory.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import asdict
from typing import Any

from fastapi import APIRouter, Query, Request

from api.deps import AUTH_ERRORS, BODY_ERRORS, READ, WRITE, CallerDep, OwnerQuery, ServiceDep
from api.errors import APIError, documented, invalid, media_type
from api.views import listing
from service.errors import ServiceError
from service.files import FileError, check_filename
from service.service import Service

try:  # pyproject pins it; without it only this way of uploading is refused, with a 415 that says so
    from python_multipart.exceptions import FormParserError
    from python_multipart.multipart import MultipartParser, parse_options_header
except ImportError:  # pragma: no cover
    MultipartParser = None

FIELD = "file"


class _Parts:
    """The parser's callbacks: the file field's name and data, refusing any other field."""

    def __init__(self) -> None:
        self.headers: dict[bytes, bytes] = {}
        self._field, self._value = b"", b""
        self.filename: str | None = None  # set once the file field's headers are read
        self.data: list[bytes] = []  # file data parsed and not yet handed on
        self.ended = False

    def callbacks(self) -> dict:
        return {
            "on_part_begin": self._begin,
            "on_header_field": lambda d, s, e: setattr(self, "_field", self._field + d[s:e]),
            "on_header_value": lambda d, s, e: setattr(self, "_value", self._value + d[s:e]),
            "on_header_end": self._header_end,
            "on_headers_finished": self._headers_finished,
            "on_part_data": lambda d, s, e: self.data.append(d[s:e]),
            "on_end": lambda: setattr(self, "ended", True),
        }

    def _begin(self) -> None:
        self.headers = {}

    def _header_end(self) -> None:
        self.headers[self._field.lower()] = self._value
        self._field, self._value = b"", b""

    def _headers_finished(self) -> None:
        _, options = parse_options_header(self.headers.get(b"content-disposition", b""))
        name = options.get(b"name", b"").decode("utf-8", "replace")
        if name != FIELD:
            why = f"send the file as the one form field '{FIELD}' (curl -F {FIELD}=@train.jsonl)"
            raise APIError(422, f"{name or 'form field'}: {why}", name or FIELD, "invalid_value")
        if self.filename is not None:
            raise invalid(FIELD, "send one file per upload")
        if b"filename" not in options:
            raise invalid(FIELD, f"the form field must be a file with a file name (curl -F {FIELD}=@path)")
        self.filename = options[b"filename"].decode("utf-8", "replace")


def _malformed(why: str) -> APIError:
    return invalid("body", why, "invalid_multipart", 400)


async def multipart_file(request: Request) -> tuple[str, AsyncIterator[bytes]]:
    """(the file's name, its content as it arrives) of a multipart upload's `file` field."""
    if MultipartParser is None:
        why = "this service cannot read forms (python-multipart is not installed): send the raw body with ?filename="
        raise invalid("body", why, "unsupported_media_type", 415)
    _, options = parse_options_header(request.headers.get("content-type", ""))
    if not options.get(b"boundary"):
        raise _malformed("a multipart/form-data body needs a boundary in its Content-Type")
    parts = _Parts()
    parser = MultipartParser(options[b"boundary"], parts.callbacks())
    stream = request.stream().__aiter__()

    async def feed() -> bool:
        """Parse the next chunk of the body; False at its end."""
        try:
            chunk = await stream.__anext__()
        except StopAsyncIteration:
            return False
        try:
            parser.write(chunk)
        except FormParserError as err:
            raise _malformed(f"the multipart body could not be parsed ({err})") from None
        return True

    while parts.filename is None:
        if not await feed():
            raise invalid(
                FIELD, f"no file in the form: send it as the field '{FIELD}' (curl -F {FIELD}=@train.jsonl)"
            )

    async def content() -> AsyncIterator[bytes]:
        while True:
            data, parts.data = parts.data, []
            for piece in data:
                if piece:
                    yield piece
            if not await feed():
                break
        if not parts.ended:
            raise _malformed("the multipart body ended before its closing boundary")

    return parts.filename, content()


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
    if media_type(request.headers.get("content-type")) == "multipart/form-data":
        sent_as, chunks = await multipart_file(request)
        name, field = filename or sent_as, FIELD
    elif filename is None:
        raise invalid(
            "filename",
            f"give the file's name, ?filename=train.jsonl, or send a form (curl -F {FIELD}=@train.jsonl)",
        )
    else:
        name, field, chunks = filename, "body", request.stream()
    check_filename(name)
    service.check_storage(caller.owner, adding=1)  # an owner at its stored bytes can add nothing
    try:
        record = await service.files.save(name, _within_storage(chunks, service, caller.owner), caller.owner)
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


async def _within_storage(chunks: AsyncIterator[bytes], service: Service, owner: str) -> AsyncIterator[bytes]:
    """The stream, refused (403) as soon as it passes the owner's stored bytes, not once written whole."""
    left, sent = service.storage_left(owner), 0
    async for chunk in chunks:
        sent += len(chunk)
        if left is not None and sent > left:
            service.check_storage(owner, adding=sent)  # raises unless files were deleted meanwhile
            left = service.storage_left(owner)
        yield chunk


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
