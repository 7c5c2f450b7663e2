"""An upload sent as multipart/form-data (`curl -F file=@train.jsonl`), streamed to the file store.

The body is parsed as it arrives (python-multipart's streaming parser): the one form field `file`
is read for its file name and handed on chunk by chunk, so an upload is never held whole in memory
and never written twice; the request body size limit (api/middleware.py) applies as to a raw upload.
Anything else is refused with the field at fault: a body without a boundary or cut short (`body`),
no `file` field, another field, or a second file (`file`, or the field's own name).
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from fastapi import Request

from api.errors import APIError

try:  # pyproject pins it; without it only this way of uploading is refused, with a 415 that says so
    from python_multipart.exceptions import FormParserError
    from python_multipart.multipart import MultipartParser, parse_options_header
except ImportError:  # pragma: no cover
    MultipartParser = None

FIELD = "file"


def is_multipart(request: Request) -> bool:
    kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
    return kind == "multipart/form-data"


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
            raise _refused(f"{name or 'form field'}: send the file as the one form field '{FIELD}' "
                           f"(curl -F {FIELD}=@train.jsonl)", name or FIELD)  # fmt: skip
        if self.filename is not None:
            raise _refused(f"{FIELD}: send one file per upload", FIELD)
        if b"filename" not in options:
            raise _refused(f"{FIELD}: the form field must be a file with a file name (curl -F {FIELD}=@path)",
                           FIELD)  # fmt: skip
        self.filename = options[b"filename"].decode("utf-8", "replace")


def _refused(message: str, param: str) -> APIError:
    return APIError(422, message, param, "invalid_value")


async def multipart_file(request: Request) -> tuple[str, AsyncIterator[bytes]]:
    """(the file's name, its content as it arrives) of a multipart upload's `file` field."""
    if MultipartParser is None:
        raise APIError(415, "body: this service cannot read forms (python-multipart is not installed): "
                       "send the raw body with ?filename=", "body", "unsupported_media_type")  # fmt: skip
    _, options = parse_options_header(request.headers.get("content-type", ""))
    if not options.get(b"boundary"):
        raise APIError(400, "body: a multipart/form-data body needs a boundary in its Content-Type", "body",
                       "invalid_multipart")  # fmt: skip
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
            raise APIError(400, f"body: the multipart body could not be parsed ({err})", "body",
                           "invalid_multipart") from None  # fmt: skip
        return True

    while parts.filename is None:
        if not await feed():
            raise _refused(f"{FIELD}: no file in the form: send it as the field '{FIELD}' "
                           f"(curl -F {FIELD}=@train.jsonl)", FIELD)  # fmt: skip

    async def content() -> AsyncIterator[bytes]:
        while True:
            data, parts.data = parts.data, []
            for piece in data:
                if piece:
                    yield piece
            if not await feed():
                break
        if not parts.ended:
            raise APIError(400, "body: the multipart body ended before its closing boundary", "body",
                           "invalid_multipart")  # fmt: skip

    return parts.filename, content()
