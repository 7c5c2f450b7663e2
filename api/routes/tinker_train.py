"""Tinker API: training models. Each route but `get_info` types its body, checks it and queues its work
(service/tinker_service.py), and answers a future at once. `forward_backward` arrives as protobuf (the
SDK's, zstd when asked) or JSON (curl), read by api/tinker_bodies.py; `forward` is it with `forward_only`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import APIRouter, Request

from api.routes.tinker_session import caller, future_answer, in_thread, tinker
from api.tinker_bodies import forward_body, parsed
from service.tinker_exports import save_external
from service.tinker_requests import CreateModel, LoadWeights, ModelRef, OptimStep, SaveExternal, SaveWeights
from service.tinker_sampling import save_for_sampler
from service.tinker_service import TinkerError, TinkerService

router = APIRouter(prefix="/api/v1", tags=["tinker"], include_in_schema=False)  # the SDK's protocol

# path -> (request body, the service's work on it: (service, owner, body) -> future, summary)
QUEUED: dict[str, tuple[type, Callable[..., Any], str]] = {
    "create_model": (CreateModel, TinkerService.create_model, "a LoRA training model on a served base"),
    "optim_step": (OptimStep, TinkerService.optim_step, "one Adam step on the accumulated gradients"),
    "save_weights": (SaveWeights, TinkerService.save_state, "save_state (adapter and optimizer state)"),
    "save_weights_external": (SaveExternal, save_external, "the adapter's PEFT files, for signed URLs"),
    "load_weights": (LoadWeights, TinkerService.load_state, "load_state, or a training model from a state"),
    "save_weights_for_sampler": (SaveWeights, save_for_sampler, "a frozen snapshot of the adapter to sample"),
    "unload_model": (ModelRef, TinkerService.unload, "drop a training model (its checkpoints stay)"),
}


def queued_route(model: type, work: Callable[..., Any]) -> Callable[..., Any]:
    async def route(request: Request) -> dict[str, Any]:
        who, body = await caller(request), await parsed(request, model)
        future = await in_thread(work, tinker(request), who.owner, body)
        return future_answer(future, model_id=getattr(body, "model_id", None))

    return route


for path, (model, work, summary) in QUEUED.items():
    router.add_api_route(
        f"/{path}", queued_route(model, work), methods=["POST"], summary=f"Tinker: {summary}"
    )


@router.post("/get_info", summary="Tinker: a training model's base, rank and tokenizer")
async def get_info(request: Request) -> dict[str, Any]:
    who = await caller(request, "read")
    return tinker(request).info((await parsed(request, ModelRef)).model_id, who.sees)


@router.post("/forward_backward", summary="Tinker: forward and backward of a batch (accumulates gradients)")
async def forward_backward(request: Request) -> dict[str, Any]:
    who, req = await caller(request), await forward_body(request)
    if not req["model_id"]:
        raise TinkerError(400, "model_id: required", "model_id")
    future = await in_thread(tinker(request).forward_backward, who.owner, req, req["forward_only"])
    return future_answer(future, model_id=req["model_id"])


@router.post("/forward", summary="Tinker: forward only (log-probs and the loss, no gradients)")
async def forward(request: Request) -> dict[str, Any]:
    who, req = await caller(request), await forward_body(request)
    future = await in_thread(tinker(request).forward_backward, who.owner, req, True)
    return future_answer(future, model_id=req["model_id"])
