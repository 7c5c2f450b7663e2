"""Tinker API: training models (create, info, forward/backward, optimizer step, state, unload).

Each route checks its request (service/tinker_service.py) and answers a future at once; the work
runs on the base model's session host and the SDK polls `/api/v1/retrieve_future` for it.
`forward_backward` arrives as protobuf (the SDK's only encoding for it, zstd-compressed when asked)
or as JSON (for curl); `forward` is the same call with `forward_only`.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from api.routes.tinker_common import caller, future_answer, json_body, text, tinker
from service.tinker_service import TinkerError
from service.tinker_wire import WireError, read_forward_backward

router = APIRouter(
    prefix="/api/v1", tags=["tinker"], include_in_schema=False
)  # the SDK's protocol: docs/tinker.md


@router.post("/create_model", summary="Tinker: a LoRA training model on a served base")
async def create_model(request: Request) -> dict[str, Any]:
    who = await caller(request)
    body = await json_body(request)
    text(body, "session_id"), text(body, "base_model")
    if not isinstance(body.get("model_seq_id"), int):
        raise TinkerError(400, "model_seq_id: required, an integer", "model_seq_id")
    future = tinker(request).create_model(who.owner, body)
    return future_answer(future)


@router.post("/get_info", summary="Tinker: a training model's base, rank and tokenizer")
async def get_info(request: Request) -> dict[str, Any]:
    who = await caller(request, "read")
    return tinker(request).info(text(await json_body(request), "model_id"), who.sees)


def _json_forward(body: dict[str, Any]) -> dict[str, Any]:
    """A JSON ForwardBackwardRequest in the shape the protobuf reader gives."""
    given = body.get("forward_backward_input") or {}
    data = []
    for i, datum in enumerate(given.get("data") or []):
        tokens: list[int] = []
        for j, chunk in enumerate((datum.get("model_input") or {}).get("chunks") or []):
            if chunk.get("type", "encoded_text") != "encoded_text":
                raise TinkerError(400, f"forward_backward_input.data[{i}].model_input.chunks[{j}]: only text chunks "
                                  "are supported", f"forward_backward_input.data[{i}].model_input")  # fmt: skip
            tokens += [int(t) for t in chunk.get("tokens") or []]
        inputs = {
            name: {"data": t.get("data") or [], "dtype": t.get("dtype", "float32"),
                   "shape": t.get("shape") or [len(t.get("data") or [])]}
            for name, t in (datum.get("loss_fn_inputs") or {}).items()
        }  # fmt: skip
        data.append({"tokens": tokens, "loss_fn_inputs": inputs})
    return {"model_id": body.get("model_id") or "", "data": data, "loss_fn": given.get("loss_fn") or "",
            "loss_fn_config": given.get("loss_fn_config"), "forward_only": bool(body.get("forward_only"))}  # fmt: skip


async def _forward_request(request: Request) -> dict[str, Any]:
    raw = await request.body()
    if request.headers.get("content-encoding", "").lower() == "zstd":
        try:
            import zstandard
        except ImportError:
            raise TinkerError(400, "Content-Encoding: zstd is not installed here; send the body uncompressed",
                              "Content-Encoding") from None  # fmt: skip
        try:
            raw = zstandard.ZstdDecompressor().decompress(raw, max_output_size=256 * 1024 * 1024)
        except zstandard.ZstdError as err:
            raise TinkerError(400, f"body: not a zstd frame ({err})", "body") from None
    if "protobuf" in request.headers.get("content-type", ""):
        try:
            return read_forward_backward(raw)
        except WireError as err:
            raise TinkerError(400, str(err), err.field) from None
        except (UnicodeDecodeError, IndexError) as err:
            raise TinkerError(400, f"body: not a ForwardBackwardRequest ({err})", "body") from None
    return _json_forward(await json_body(request))


@router.post("/forward_backward", summary="Tinker: forward and backward of a batch (accumulates gradients)")
async def forward_backward(request: Request) -> dict[str, Any]:
    who = await caller(request)
    req = await _forward_request(request)
    if not req["model_id"]:
        raise TinkerError(400, "model_id: required", "model_id")
    future = tinker(request).forward_backward(who.owner, req, forward_only=req["forward_only"])
    return future_answer(future, model_id=req["model_id"])


@router.post("/forward", summary="Tinker: forward only (log-probs and the loss, no gradients)")
async def forward(request: Request) -> dict[str, Any]:
    who = await caller(request)
    req = await _forward_request(request)
    future = tinker(request).forward_backward(who.owner, req, forward_only=True)
    return future_answer(future, model_id=req["model_id"])


@router.post("/optim_step", summary="Tinker: one Adam step on the accumulated gradients")
async def optim_step(request: Request) -> dict[str, Any]:
    who = await caller(request)
    body = await json_body(request)
    future = tinker(request).optim_step(who.owner, {"model_id": text(body, "model_id"), **body})
    return future_answer(future, model_id=body["model_id"])


@router.post(
    "/save_weights", summary="Tinker: save_state (adapter and optimizer state, kept across restarts)"
)
async def save_weights(request: Request) -> dict[str, Any]:
    who = await caller(request)
    body = await json_body(request)
    text(body, "model_id")
    return future_answer(tinker(request).save_state(who.owner, body), model_id=body["model_id"])


@router.post(
    "/load_weights", summary="Tinker: load_state / load_state_with_optimizer, or a model from a state"
)
async def load_weights(request: Request) -> dict[str, Any]:
    who = await caller(request)
    body = await json_body(request)
    text(body, "path")
    if not body.get("model_id"):
        text(body, "session_id")
    future = tinker(request).load_state(who.owner, body)
    return future_answer(future, model_id=body.get("model_id"))


@router.post("/save_weights_for_sampler", summary="Tinker: a frozen snapshot of the adapter for sampling")
async def save_weights_for_sampler(request: Request) -> dict[str, Any]:
    from service.tinker_sampling import save_for_sampler

    who = await caller(request)
    body = await json_body(request)
    text(body, "model_id")
    return future_answer(save_for_sampler(tinker(request), who.owner, body), model_id=body["model_id"])


@router.post("/unload_model", summary="Tinker: drop a training model (its checkpoints stay)")
async def unload_model(request: Request) -> dict[str, Any]:
    who = await caller(request)
    model_id = text(await json_body(request), "model_id")
    return future_answer(tinker(request).unload(who.owner, model_id), model_id=model_id)
