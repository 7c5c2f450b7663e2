"""Tinker request bodies read off the event loop, with caps on their raw and decompressed size: a large
body is decoded and typed in a worker thread, so that one hostile body does not stall every other
request, and a zstd body is read as a stream that stops at its cap (a 413), never expanded whole."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import anyio
from fastapi import Request
from pydantic import BaseModel

from service.tinker_requests import ForwardBackward, parse_body
from service.tinker_service import TinkerError
from service.tinker_wire import WireError, read_forward_backward

INLINE_BYTES = 64 * 1024  # smaller bodies parse in well under a millisecond: no thread hop
PARSE_THREADS = 4  # bodies decoded at once: bounds the memory their decoded forms take
MAX_RATIO = 64  # a real body compresses a few times; FLOOR_BYTES is always allowed, for tiny bodies
FLOOR_BYTES = 1024 * 1024
READ_BYTES = 256 * 1024

Model = TypeVar("Model", bound=BaseModel)
_limiter: anyio.CapacityLimiter | None = None


async def off_loop(work: Callable[[], Any], size: int) -> Any:
    """`work()` in a worker thread when the body is large, else here."""
    global _limiter
    if size <= INLINE_BYTES:
        return work()
    if _limiter is None:
        _limiter = anyio.CapacityLimiter(PARSE_THREADS)
    return await anyio.to_thread.run_sync(work, limiter=_limiter)


async def parsed(request: Request, model: type[Model]) -> Model:
    """The JSON body as `model`, or a 400 naming the field."""
    raw = await request.body()
    return await off_loop(lambda: parse_body(model, raw), len(raw))


def decompressed(raw: bytes, cap: int) -> bytes:
    """A zstd body, read as a stream; a 413 as soon as its output passes what `raw` may expand to."""
    import zstandard

    limit = min(cap, max(FLOOR_BYTES, MAX_RATIO * len(raw)))
    out = bytearray()
    try:
        with zstandard.ZstdDecompressor().stream_reader(raw, read_across_frames=True) as reader:
            while chunk := reader.read(READ_BYTES):
                out += chunk
                if len(out) > limit:
                    raise TinkerError(413, f"body: the zstd body expands past {limit} bytes ({len(raw)} "
                                      f"compressed; at most {MAX_RATIO}x, up to {cap}), more than a "
                                      "forward_backward request of the models served needs", "body")  # fmt: skip
    except zstandard.ZstdError as err:
        raise TinkerError(400, f"body: not a zstd frame ({err})", "body") from None
    return bytes(out)


def forward_request(raw: bytes, encoding: str, content_type: str, cap: int) -> dict[str, Any]:
    """A forward/forward_backward body (zstd or not, protobuf or JSON) in the protobuf reader's shape,
    typed: finite floats, whole token ids, consistent tensor shapes."""
    if encoding == "zstd":
        raw = decompressed(raw, cap)
    elif encoding not in ("", "identity"):
        raise TinkerError(
            400, f"Content-Encoding: {encoding!r} is not served (zstd or none)", "Content-Encoding"
        )
    if "protobuf" not in content_type:
        return parse_body(ForwardBackward, raw).plain()
    try:
        read = read_forward_backward(raw)
    except WireError as err:
        raise TinkerError(400, str(err), err.field) from None
    data = [{"model_input": {"chunks": [{"tokens": d.pop("tokens")}]}, **d} for d in read["data"]]
    given = {"data": data, "loss_fn": read["loss_fn"], "loss_fn_config": read["loss_fn_config"]}
    return parse_body(ForwardBackward, {**read, "forward_backward_input": given}).plain()


async def forward_body(request: Request) -> dict[str, Any]:
    raw = await request.body()
    cap = request.app.state.settings.tinker_max_decompressed_bytes
    encoding = request.headers.get("content-encoding", "").strip().lower()
    kind = request.headers.get("content-type", "")
    size = len(raw) * (MAX_RATIO if encoding == "zstd" else 1)  # what it may become
    return await off_loop(lambda: forward_request(raw, encoding, kind, cap), size)
