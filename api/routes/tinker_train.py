"""Tinker API: training models (create, info, forward/backward, optimizer step, state, unload).

Each route checks its request (service/tinker_service.py) and answers a future at once. `forward_backward`
arrives as protobuf (the SDK's encoding, zstd when asked) or JSON (curl), read off the event loop with
caps (api/tinker_bodies.py); `forward` is the same call with `forward_only`.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from api.routes.tinker_session import caller, future_answer, in_thread, tinker
from api.tinker_bodies import forward_body, parsed
from service.tinker_exports import save_external
from service.tinker_requests import CreateModel, LoadWeights, ModelRef, OptimStep, SaveExternal, SaveWeights
from service.tinker_sampling import save_for_sampler
from service.tinker_service import TinkerError

router = APIRouter(prefix="/api/v1", tags=["tinker"], include_in_schema=False)  # the SDK's protocol


@router.post("/create_model", summary="Tinker: a LoRA training model on a served base")
async def create_model(request: Request) -> dict[str, Any]:
    who = await caller(request)
    future = await in_thread(tinker(request).create_model, who.owner, await parsed(request, CreateModel))
    return future_answer(future)


@router.post("/get_info", summary="Tinker: a training model's base, rank and tokenizer")
async def get_info(request: Request) -> dict[str, Any]:
    who = await caller(request, "read")
    return tinker(request).info((await parsed(request, ModelRef)).model_id, who.sees)


@router.post("/forward_backward", summary="Tinker: forward and backward of a batch (accumulates gradients)")
async def forward_backward(request: Request) -> dict[str, Any]:
    who = await caller(request)
    req = await forward_body(request)
    if not req["model_id"]:
        raise TinkerError(400, "model_id: required", "model_id")
    future = await in_thread(tinker(request).forward_backward, who.owner, req, req["forward_only"])
    return future_answer(future, model_id=req["model_id"])


@router.post("/forward", summary="Tinker: forward only (log-probs and the loss, no gradients)")
async def forward(request: Request) -> dict[str, Any]:
    who = await caller(request)
    req = await forward_body(request)
    future = await in_thread(tinker(request).forward_backward, who.owner, req, True)
    return future_answer(future, model_id=req["model_id"])


@router.post("/optim_step", summary="Tinker: one Adam step on the accumulated gradients")
async def optim_step(request: Request) -> dict[str, Any]:
    who = await caller(request)
    body = await parsed(request, OptimStep)
    return future_answer(await in_thread(tinker(request).optim_step, who.owner, body), model_id=body.model_id)


@router.post(
    "/save_weights", summary="Tinker: save_state (adapter and optimizer state, kept across restarts)"
)
async def save_weights(request: Request) -> dict[str, Any]:
    who, body = await caller(request), await parsed(request, SaveWeights)
    return future_answer(await in_thread(tinker(request).save_state, who.owner, body), model_id=body.model_id)


@router.post("/save_weights_external", summary="Tinker: the adapter's PEFT files, for signed-URL downloads")
async def save_weights_external(request: Request) -> dict[str, Any]:
    who, body = await caller(request), await parsed(request, SaveExternal)
    return future_answer(
        await in_thread(save_external, tinker(request), who.owner, body), model_id=body.model_id
    )


@router.post(
    "/load_weights", summary="Tinker: load_state / load_state_with_optimizer, or a model from a state"
)
async def load_weights(request: Request) -> dict[str, Any]:
    who, body = await caller(request), await parsed(request, LoadWeights)
    if body.model_id is None and body.session_id is None:
        raise TinkerError(400, "session_id: required when model_id is not given", "session_id")
    return future_answer(await in_thread(tinker(request).load_state, who.owner, body), model_id=body.model_id)


@router.post("/save_weights_for_sampler", summary="Tinker: a frozen snapshot of the adapter for sampling")
async def save_weights_for_sampler(request: Request) -> dict[str, Any]:
    who, body = await caller(request), await parsed(request, SaveWeights)
    return future_answer(
        await in_thread(save_for_sampler, tinker(request), who.owner, body), model_id=body.model_id
    )


@router.post("/unload_model", summary="Tinker: drop a training model (its checkpoints stay)")
async def unload_model(request: Request) -> dict[str, Any]:
    who, model_id = await caller(request), (await parsed(request, ModelRef)).model_id
    return future_answer(await in_thread(tinker(request).unload, who.owner, model_id), model_id=model_id)
