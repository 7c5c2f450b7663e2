"""The Tinker SDK's HTTP API under /api/v1: client configuration, sessions and futures, one table of the
calls that do work (each types its body, checks it, queues its work in service/tinker_service.py and
answers at once, a queued one with a future), samplers, training runs and their checkpoints, and a 400
naming any other call as unsupported. A refusal is the SDK's `{"error", "category"}` plus `param`, the
field at fault; never a 5xx, 408 or 409, which the SDK retries instead of showing. A large body is
decoded and typed in a worker thread, so that one hostile body does not stall every other request.
`forward_backward` arrives as protobuf (the SDK's, zstd when asked) or JSON (curl)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any, TypeVar

import anyio
from fastapi import APIRouter, Query, Request
from fastapi.responses import FileResponse, Response
from pydantic import BaseModel

from api.auth import Caller
from service import tinker_checkpoints as saved
from service import tinker_requests as bodies
from service import tinker_sampling as sampling
from service.tinker_requests import MAX_RATIO, forward_request, parse_body
from service.tinker_service import TinkerError, TinkerService
from service.tinker_sessions import Future

router = APIRouter(prefix="/api/v1", tags=["tinker"], include_in_schema=False)  # the SDK's protocol
# retrieve_future waits this long before `try_again`, well within the SDK's read timeout for it (45 s)
LONG_POLL_S = 10.0
INLINE_BYTES = 64 * 1024  # smaller bodies parse in well under a millisecond: no thread hop
PARSE_THREADS = 4  # bodies decoded at once: bounds the memory their decoded forms take
Model = TypeVar("Model", bound=BaseModel)
_limiter: anyio.CapacityLimiter | None = None
# service work that may wait on a lock, the store or the disk: long polls are answered meanwhile
in_thread = anyio.to_thread.run_sync

# The SDK's feature flags (tinker/types/client_config_response.py): plain API keys, httpx, protobuf
# forward_backward in chunks, per-request future polling, client-side custom losses.
CLIENT_CONFIG = {
    "pjwt_auth_enabled": False,
    "credential_default_source": "api_key",
    "use_pyqwest_transport": False,
    "proto_compress_fwdbwd": False,
    "sample_use_retrieve_futures": False,
    "custom_loss_server_side": False,
    "sample_join_sampling_session": False,
    "fwdbwd_max_chunk_len": 1024,
    "fwdbwd_max_chunk_bytes_count": 5_000_000,  # the chunk size the body caps are sized from (api/settings.py)
}
DYNAMIC_CONFIG = {
    "refresh_interval_sec": 300,
    "sample_cancel_enabled": True,
    "sample_cancel_max_batch_size": 64,
}


async def off_loop(work: Callable[[], Any], size: int) -> Any:
    """`work()` in a worker thread when the body is large, else here."""
    global _limiter
    if size <= INLINE_BYTES:
        return work()
    if _limiter is None:
        _limiter = anyio.CapacityLimiter(PARSE_THREADS)
    return await anyio.to_thread.run_sync(work, limiter=_limiter)


async def parsed(request: Request, model: type[Model]) -> Model | dict[str, Any]:
    """The body as `model`, or a 400 naming the field; a forward's (`ForwardBackward`: protobuf or JSON,
    zstd or not) in the shape the host's forward takes."""
    raw = await request.body()
    if not issubclass(model, bodies.ForwardBackward):
        return await off_loop(lambda: parse_body(model, raw), len(raw))
    cap = request.app.state.settings.tinker_max_decompressed_bytes
    encoding = request.headers.get("content-encoding", "").strip().lower()
    kind = request.headers.get("content-type", "")
    size = len(raw) * (MAX_RATIO if encoding == "zstd" else 1)  # what it may become
    return await off_loop(lambda: forward_request(model, raw, encoding, kind, cap), size)


def tinker(request: Request) -> TinkerService:
    return request.app.state.tinker


async def caller(request: Request, scope: str = "write") -> Caller:
    return await request.app.state.auth.require(request, scope)


# path -> (scope, answer): the calls whose answer is the same for every request; the SDK's telemetry
# is accepted and dropped (nothing leaves the machine)
CONSTANT = {"client/config": ("read", CLIENT_CONFIG), "client/dynamic_config": ("read", DYNAMIC_CONFIG),
            "telemetry": ("write", {"status": "accepted"})}  # fmt: skip


def constant_route(scope: str, answer: dict[str, Any]) -> Callable[..., Any]:
    async def route(request: Request) -> dict[str, Any]:
        await caller(request, scope)
        return answer

    return route


for path, (scope, answer) in CONSTANT.items():
    router.add_api_route(f"/{path}", constant_route(scope, answer), methods=["POST"], include_in_schema=False)


@router.get("/healthz", include_in_schema=False)
async def healthz() -> dict[str, str]:
    return {"status": "ok"}


# path -> (request body, the service's work on it: (service, owner, body) -> future or answer, summary);
# the owner of a "read" call or a heartbeat is None for the admin, who sees every owner's
ROUTES: dict[str, tuple[type, Callable[..., Any], str]] = {
    "create_session": (bodies.CreateSession, TinkerService.create_session, "start a client session"),
    "session_heartbeat": (bodies.SessionRef, TinkerService.heartbeat, "keep a client session alive"),
    "get_info": (bodies.ModelRef, TinkerService.info, "a training model's base, rank and tokenizer"),
    "create_model": (bodies.CreateModel, TinkerService.create_model, "a LoRA training model on a served base"),
    "forward_backward": (bodies.ForwardBackward, TinkerService.forward_backward,
                         "forward and backward of a batch (accumulates gradients)"),
    "forward": (bodies.Forward, TinkerService.forward_backward,
                "forward only (log-probs and the loss, no gradients)"),
    "optim_step": (bodies.OptimStep, TinkerService.optim_step, "one Adam step on the accumulated gradients"),
    "save_weights": (bodies.SaveWeights, saved.save_state, "save_state (adapter and optimizer state)"),
    "save_weights_external": (bodies.SaveWeights, saved.save_external, "the adapter's PEFT files, for signed URLs"),
    "load_weights": (bodies.LoadWeights, TinkerService.load_state, "load_state, or a training model from a state"),
    "save_weights_for_sampler": (bodies.SaveWeights, saved.save_for_sampler, "a frozen snapshot of the adapter"),
    "unload_model": (bodies.ModelRef, TinkerService.unload, "drop a training model (its checkpoints stay)"),
    "create_sampling_session": (bodies.CreateSamplingSession, sampling.create_sampling_session,
                                "a sampler on a base model or a sampler checkpoint"),
    "asample": (bodies.Sample, sampling.asample, "sample completions (and log-probs) from a sampler"),
}  # fmt: skip
READS = {"get_info"}
SEES = READS | {"session_heartbeat"}


def work_route(path: str, model: type, work: Callable[..., Any]) -> Callable[..., Any]:
    async def route(request: Request) -> dict[str, Any]:
        who = await caller(request, "read" if path in READS else "write")
        body = await parsed(request, model)
        out = await in_thread(work, tinker(request), who.sees if path in SEES else who.owner, body)
        if not isinstance(out, Future):
            return out
        # an `UntypedAPIFuture`: what every queued piece of work answers at once
        model_id = body["model_id"] if isinstance(body, dict) else getattr(body, "model_id", None)
        return {"request_id": out.id, **({} if model_id is None else {"model_id": model_id})}

    return route


for path, (model, work, summary) in ROUTES.items():
    router.add_api_route(
        f"/{path}", work_route(path, model, work), methods=["POST"], summary=f"Tinker: {summary}"
    )


async def _future(request: Request) -> Any:
    """The caller's future named by the body's request_id; another owner's is a 404 like an unknown one."""
    who = await caller(request)
    request_id = (await parsed(request, bodies.FutureRef)).request_id
    return tinker(request).futures.find(request_id, who.sees)


@router.get("/auth/apikey/me", summary="Tinker: the presented key's public record (`tinker auth login`)")
async def own_key(request: Request) -> dict[str, Any]:
    who = await caller(request, "read")
    record = tinker(request).store.key(who.key_id) or {}
    return {"key_id": int(who.key_id.removeprefix("key-"), 16), "name": record.get("name", ""), "note": "",
            "details": {"org_details": {"name": "tandem"}, "user_details": {"email": who.owner}}}  # fmt: skip


@router.delete("/auth/apikey/me", summary="Tinker: revoke the presented key (`tinker auth logout`)")
async def revoke_own_key(request: Request) -> dict[str, Any]:
    """Whoever holds a key may revoke it, a read-only one too; the admin token is replaced, not revoked."""
    who = await caller(request, "read")
    if who.admin:
        raise TinkerError(400, "the admin token cannot revoke itself: restart the service with a new "
                          "TANDEM_ADMIN_TOKEN, or its admin_token file deleted, to replace it", "X-API-Key")  # fmt: skip
    tinker(request).store.revoke_key(who.key_id)
    return {"revoked": who.key_id}


@router.post("/retrieve_future", summary="Tinker: a future's result, or try_again")
async def retrieve_future(request: Request) -> Any:
    future = await _future(request)
    deadline, pause = time.monotonic() + LONG_POLL_S, 0.005
    while not future.done and time.monotonic() < deadline:
        await asyncio.sleep(pause)
        pause = min(pause * 1.5, 0.05)
    if not future.done:
        return {"type": "try_again", "request_id": future.id, "queue_state": "active"}
    tinker(request).futures.read(future)
    if isinstance(future.answer, bytes):
        return Response(future.answer, media_type="application/x-protobuf")
    return future.answer


@router.post("/cancel_future", summary="Tinker: cancel a queued request")
async def cancel_future(request: Request) -> dict[str, Any]:
    return {"cancelled": tinker(request).futures.cancel(await _future(request))}


def run_of(svc: TinkerService, owner: str | None, run_id: str) -> Any:
    """The caller's training run, named by its id or by its model's id."""
    job = saved.run_row(svc.store, run_id, owner)
    model = svc.records.models.seen(run_id, owner) if job is None else None
    if job is None and model is None:
        raise bodies.not_found("training run", run_id, "training_run_id")
    return job or svc.store.get_job(model.job_id)


@router.get("/training_runs", summary="Tinker: the caller's training runs")
async def training_runs(request: Request, limit: int = Query(20, ge=1, le=1000),
                        offset: int = Query(0, ge=0, le=10**9)) -> dict[str, Any]:  # fmt: skip
    who = await caller(request, "read")
    rows = tinker(request).store.tinker_runs(who.sees)  # newest first; an admin's: everyone's
    views = await in_thread(lambda: [saved.run_view(j) for j in rows[offset : offset + limit]])
    return {"training_runs": views, "cursor": {"offset": offset, "limit": limit, "total_count": len(rows)}}


def session_view(svc: TinkerService, owner: str | None, session_id: str) -> dict[str, Any]:
    session = svc.records.sessions.find(session_id, owner)
    runs = [m.job_id for m in svc.records.models.of(None) if m.session_id == session.id]
    samplers = [s.id for s in svc.records.samplers.of(None) if s.id.startswith(session.id + ":")]
    return {"training_run_ids": runs, "sampler_ids": samplers}


def checkpoints(svc: TinkerService, owner: str | None, run_id: str) -> dict[str, Any]:
    job = run_of(svc, owner, run_id)
    return {"checkpoints": saved.list_checkpoints(job.id, job.workdir)}


# "METHOD path" -> (scope, (service, the owner the caller sees, path parameters) -> answer; None is {}):
# the calls without a body
PLAIN: dict[str, tuple[str, Callable[..., Any]]] = {
    "GET get_server_capabilities": ("read", lambda svc, _: svc.capabilities()),
    "POST sessions/{session_id}/finish": ("write", TinkerService.finish_session),
    "GET sessions": ("read", lambda svc, owner: {"sessions": [s.id for s in svc.records.sessions.of(owner)]}),
    "GET sessions/{session_id}": ("read", session_view),
    "GET samplers/{sampler_id}": ("read", sampling.sampler_view),
    "GET training_runs/{run_id}": ("read", lambda svc, owner, run_id: saved.run_view(run_of(svc, owner, run_id))),
    "GET training_runs/{run_id}/checkpoints": ("read", checkpoints),
    "DELETE training_runs/{run_id}/checkpoints/{kind}/{name}": ("write", saved.delete),
}  # fmt: skip


def plain_route(scope: str, work: Callable[..., Any]) -> Callable[..., Any]:
    async def route(request: Request) -> Any:
        who = await caller(request, scope)
        out = await in_thread(lambda: work(tinker(request), who.sees, **request.path_params))
        return {} if out is None else out

    return route


for key, (scope, work) in PLAIN.items():
    method, path = key.split(" ")
    router.add_api_route(f"/{path}", plain_route(scope, work), methods=[method])


@router.put("/training_runs/{run_id}/checkpoints/{kind}/{name}/ttl", summary="Tinker: set or clear a TTL")
async def checkpoint_ttl(request: Request, run_id: str, kind: str, name: str) -> dict[str, Any]:
    who, body = await caller(request), await parsed(request, bodies.CheckpointTtl)
    _, folder = await in_thread(saved.saved_folder, tinker(request).store, who.sees, run_id, kind, name)
    saved.set_ttl(folder, body.ttl_seconds)
    return {}


@router.get("/training_runs/{run_id}/checkpoints/{kind}/{name}/archive",
            summary="Tinker: a checkpoint as a .tar.gz of its PEFT adapter folder")  # fmt: skip
async def checkpoint_archive(request: Request, run_id: str, kind: str, name: str) -> Response:
    who = await caller(request, "read")
    _, folder = saved.saved_folder(tinker(request).store, who.sees, run_id, kind, name)
    data = await in_thread(saved.archive, folder, name)
    return Response(data, media_type="application/gzip",
                    headers={"Content-Disposition": f'attachment; filename="{run_id}-{name}.tar.gz"'})  # fmt: skip


@router.get("/training_runs/{run_id}/checkpoints/external_weights/{name}/external_weights_urls",
            summary="Tinker: signed download URLs of external weights")  # fmt: skip
async def external_weights_urls(request: Request, run_id: str, name: str) -> dict[str, Any]:
    who, svc = await caller(request, "read"), tinker(request)
    _, folder = saved.saved_folder(svc.store, who.sees, run_id, "external_weights", name)
    return saved.signed_urls(svc.url_secret, str(request.base_url), run_id, name, folder)


@router.get("/external_weights/{run_id}/{name}/{file}", summary="Tinker: one file of a signed URL (no key)")
async def external_weights_file(
    request: Request, run_id: str, name: str, file: str,
    expires: int = Query(..., ge=0, lt=2**63), signature: str = Query(..., max_length=128),
) -> FileResponse:  # fmt: skip
    svc = tinker(request)
    path = await in_thread(
        saved.signed_file, svc.url_secret, svc.store, run_id, name, file, expires, signature
    )
    return FileResponse(path, media_type="application/octet-stream")


fallback = APIRouter()  # registered after every Tinker route


@fallback.api_route(
    "/api/v1/{rest:path}", methods=["GET", "POST", "PUT", "PATCH", "DELETE"], include_in_schema=False
)
async def unsupported(request: Request, rest: str) -> None:
    """Anything else under /api/v1 is named and refused at once."""
    await caller(request, "read")
    message = (f"unsupported feature: {request.method} /api/v1/{rest} is a Tinker API call that Tandem does "
               "not serve (docs/tinker.md lists what is compatible)")  # fmt: skip
    raise TinkerError(400, message, rest.split("/")[0])
