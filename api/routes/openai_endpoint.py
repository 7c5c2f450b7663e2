"""A job's OpenAI-compatible endpoint in the API process (docs/ARCHITECTURE.md §5.1), torch-free: the
checks the job's record allows here, then the call to the job's `ExternalServer` actor; its error answers
come back as data and are raised in the API's error shape. The base URL `.../trajectories/{id}/v1` names
the trajectory (an agent framework sets only `base_url` and `api_key`); under `.../openai/v1` the
`X-Tandem-Trajectory` header does (else each call is its own). Streaming sends the whole answer's chunks.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Iterator
from typing import Annotated, Any

import ray
from fastapi import APIRouter, Depends, Header, Path, Request
from fastapi.responses import JSONResponse, StreamingResponse

from api.body_checks import CheckedRoute
from api.deps import AUTH_ERRORS, BODY_ERRORS, READ, WRITE, CallerDep, ServiceDep
from api.errors import APIError, documented
from api.routes.openai_responses import ResponsesRequest, chat_request, name_responses_field, response_object
from api.routes.openai_responses import stream_events as responses_events
from schema.external import server_name
from schema.openai_bodies import ChatCompletionRequest, CompletionRequest, RewardRequest
from service.service import Service

REQUEST_TIMEOUT_S = 900.0  # a call may wait for a training step's update on a colocated worker
LOOKUP_TIMEOUT_S = 10.0  # finding the job's endpoint actor by name (a GCS call)
STARTING_WAIT_S = 120.0  # a running job's first calls wait this long for its endpoint actor
STARTING_POLL_S = 0.5
_servers: dict[str, Any] = {}  # job id -> actor handle, for this API process

TRAJECTORY_ID = r"^[A-Za-z0-9_.:-]+$"
TAGS: list[Any] = ["openai-compatible endpoint"]
router = APIRouter(
    prefix="/v1/jobs/{job_id}/openai",
    tags=TAGS,
    route_class=CheckedRoute,
    responses={**AUTH_ERRORS, **BODY_ERRORS, **documented(404, 409, 429, 503)},
)
calls = APIRouter(route_class=CheckedRoute)  # included twice below: under the base URL and under the header
trajectories = APIRouter(
    prefix="/v1/jobs/{job_id}/trajectories",
    tags=TAGS,
    route_class=CheckedRoute,
    responses={**AUTH_ERRORS, **BODY_ERRORS, **documented(404, 409, 503)},
)
TrajectoryId = Path(..., min_length=1, max_length=128, pattern=TRAJECTORY_ID)


def _by_header(
    trajectory: str | None = Header(
        None, alias="X-Tandem-Trajectory", min_length=1, max_length=128, pattern=TRAJECTORY_ID
    ),
) -> None:
    """Checks the header that names a call's trajectory under `.../openai/v1`."""


def _by_path(trajectory_id: str = TrajectoryId) -> None:
    """Checks the trajectory id of the base URL `.../openai/trajectories/{trajectory_id}/v1`."""


def _trajectory(request: Request) -> str | None:
    """The trajectory the base URL or the header names (checked by the router that served the call)."""
    return request.path_params.get("trajectory_id") or request.headers.get("x-tandem-trajectory")


TrajectoryDep = Annotated[str | None, Depends(_trajectory)]


def external_job(service: Service, job_id: str, sees: str | None, model: str | None = None) -> Any:
    """The job's record when it can serve calls (for `model`): 404 unknown, 409 not fed externally or
    not running, 404 a model it does not serve."""
    job = service.get(job_id, sees)
    if (job.spec.get("rollout") or {}).get("source") != "external":
        raise APIError(409, f"job '{job_id}' is not fed externally: submit it with rollout.source: external",
                       "job_id", "not_external")  # fmt: skip
    running(job)
    if model is not None and model not in model_names(job):
        raise APIError(404, f"model '{model}' is not served here; this endpoint serves '{job.id}'",
                       "model", "model_not_found")  # fmt: skip
    return job


def running(job: Any) -> None:
    """A 409 naming the job's state unless it runs (its endpoint and trajectories go with its run)."""
    if job.status != "running":
        raise APIError(409, f"job '{job.id}' is {job.status}: its endpoint serves only while it runs",
                       "job_id", "not_running")  # fmt: skip


def model_names(job: Any) -> list[str]:
    """What `model` may say: the job's id (listed by /models), its name, or its model's builtin/path/hub id."""
    model = job.spec.get("model") or {}
    names = [job.id, job.name, model.get("builtin"), model.get("path"), model.get("hf_id")]
    return [n for n in names if n]


async def _find_server(service: Service, job_id: str) -> Any:
    """The job's endpoint actor; a job's first calls wait for it rather than answer 503, so that a client
    with default retries reaches a job that has just started (a 409 as soon as the job stops running)."""
    deadline = time.monotonic() + STARTING_WAIT_S
    while True:
        try:
            lookup = asyncio.to_thread(ray.get_actor, server_name(job_id))
            server = await asyncio.wait_for(lookup, LOOKUP_TIMEOUT_S)
            break
        except ValueError:
            running(service.get(job_id))
            if time.monotonic() >= deadline:
                raise APIError(503, f"job '{job_id}' is starting: its endpoint did not come up within "
                               f"{STARTING_WAIT_S:.0f} s", None, "endpoint_starting", {"Retry-After": "2"}) from None  # fmt: skip
            await asyncio.sleep(STARTING_POLL_S)
        except asyncio.TimeoutError:
            raise APIError(503, f"job '{job_id}''s endpoint actor {server_name(job_id)} was not found within "
                           f"{LOOKUP_TIMEOUT_S:.0f} s (Ray's control store did not answer)", None,
                           "endpoint_unavailable", {"Retry-After": "2"}) from None  # fmt: skip
    _servers[job_id] = server
    return server


async def call(service: Service, job_id: str, method: str, *args: Any) -> dict[str, Any]:
    """`ExternalServer.<method>(*args)` of the job, its error answer raised as an APIError; a call that
    its job's end (a pause, a cancel) cut off is a 409 naming the job's state, not a 503."""
    known = _servers.get(job_id)
    server = known or await _find_server(service, job_id)
    try:
        out = await asyncio.wait_for(getattr(server, method).remote(*args), REQUEST_TIMEOUT_S)
    except (ray.exceptions.RayActorError, asyncio.TimeoutError) as err:
        _servers.pop(job_id, None)
        running(service.get(job_id))
        if known is not None and isinstance(err, ray.exceptions.RayActorError):  # an earlier run's endpoint
            return await call(service, job_id, method, *args)
        raise APIError(503, f"job '{job_id}''s endpoint did not answer: {type(err).__name__}", None,
                       "endpoint_unavailable", {"Retry-After": "2"}) from None  # fmt: skip
    e = out.get("error") if isinstance(out, dict) else None
    if not isinstance(e, dict) or "status" not in e:
        return out
    if e["status"] == 503:  # its rollout workers failed under it: a pause or a cancel stops them first
        running(service.get(job_id))
    retry = {"Retry-After": str(max(1, round(e.get("retry_after") or 1)))}
    raise APIError(
        e["status"], e["message"], e.get("param"), e.get("code"), retry if e["status"] in (429, 503) else None
    )


@router.get("/v1/models", dependencies=READ)
@router.get("/trajectories/{trajectory_id}/v1/models", dependencies=READ, include_in_schema=False)
def models(job_id: str, service: ServiceDep, caller: CallerDep) -> dict[str, Any]:
    """The model this endpoint serves: the job, with its current weights."""
    job = external_job(service, job_id, caller.sees)
    created = int(job.started_at or job.created_at)
    data = [
        {"id": name, "object": "model", "created": created, "owned_by": job.owner}
        for name in model_names(job)
    ]
    return {"object": "list", "data": data}


@calls.post("/chat/completions", dependencies=WRITE)
async def chat_completions(
    job_id: str, body: ChatCompletionRequest, service: ServiceDep, caller: CallerDep, tid: TrajectoryDep
) -> Any:
    """A chat completion from the job's policy, recorded in the trajectory the URL or header names (or a new one)."""
    external_job(service, job_id, caller.sees, body.model)
    out = await call(service, job_id, "answer", "chat", tid, body.model_dump(exclude_none=True))
    if not body.stream:
        return JSONResponse(out)  # a plain dict: no encoder walk
    return _chunks(out, body, "chat.completion.chunk", _chat_deltas)


@calls.post("/completions", dependencies=WRITE)
async def completions(
    job_id: str, body: CompletionRequest, service: ServiceDep, caller: CallerDep, tid: TrajectoryDep
) -> Any:
    """A text completion (no chat template), recorded like chat calls."""
    external_job(service, job_id, caller.sees, body.model)
    payload = body.model_dump(exclude_none=True)
    payload["logprobs"] = body.logprobs is not None
    out = await call(service, job_id, "answer", "completion", tid, payload)
    return _chunks(out, body, "text_completion", _text_deltas) if body.stream else JSONResponse(out)


@calls.post("/responses", dependencies=WRITE)
async def responses(
    job_id: str, body: ResponsesRequest, service: ServiceDep, caller: CallerDep, tid: TrajectoryDep
) -> Any:
    """A response from the job's policy: the chat call that means the same, recorded like chat calls."""
    external_job(service, job_id, caller.sees, body.model)
    chat = chat_request(body)
    try:
        out = await call(service, job_id, "answer", "chat", tid, chat.model_dump(exclude_none=True))
    except APIError as err:  # the endpoint names the chat field: name the Responses one
        name_responses_field(err)
        raise
    response = response_object(out, body.model_dump(exclude_none=True))
    return _sse(responses_events(response), named=True) if body.stream else JSONResponse(response)


router.include_router(calls, prefix="/v1", dependencies=[Depends(_by_header)])
router.include_router(calls, prefix="/trajectories/{trajectory_id}/v1", dependencies=[Depends(_by_path)])


@trajectories.post("/{trajectory_id}/reward", dependencies=WRITE)
async def reward(
    job_id: str,
    body: RewardRequest,
    service: ServiceDep,
    caller: CallerDep,
    trajectory_id: str = TrajectoryId,
) -> dict[str, Any]:
    """Close the trajectory with its reward: 404 unknown, 409 already rewarded, dropped or trained on."""
    external_job(service, job_id, caller.sees)
    return await call(service, job_id, "reward", trajectory_id, body.model_dump(exclude_none=True))


@trajectories.get("/{trajectory_id}", dependencies=READ)
async def trajectory(
    job_id: str, service: ServiceDep, caller: CallerDep, trajectory_id: str = TrajectoryId
) -> dict[str, Any]:
    """The trajectory's record, token by token, while the job runs (a step's samples keep it after)."""
    external_job(service, job_id, caller.sees)
    return await call(service, job_id, "trajectory", trajectory_id)


def _sse(events: list[dict[str, Any]], named: bool = False) -> StreamingResponse:
    """Server-Sent Events of a whole answer; `named`: each event's `type` as its name (Responses)."""

    async def stream() -> Any:
        for event in events:
            yield (f"event: {event['type']}\n" if named else "") + f"data: {json.dumps(event)}\n\n"
        if not named:
            yield "data: [DONE]\n\n"

    return StreamingResponse(stream(), media_type="text/event-stream")


def _chunks(
    out: dict[str, Any], body: Any, kind: str, deltas: Callable[[list], Iterator]
) -> StreamingResponse:
    """The stream of a whole chat or text completion: `deltas` lays its choices out as chunks' choices."""
    head = {"id": out["id"], "object": kind, "created": out.get("created", int(time.time()))}
    head |= {"model": out["model"], "tandem": out.get("tandem")}
    chunks = [{**head, "choices": [choice]} for choice in deltas(out["choices"])]
    if (body.stream_options or {}).get("include_usage"):
        chunks.append({**head, "choices": [], "usage": out["usage"]})
    return _sse(chunks)


def _chat_deltas(choices: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for c in choices:
        m = c["message"]
        delta: dict[str, Any] = {"role": "assistant", "content": m.get("content")}
        if m.get("tool_calls"):
            delta["tool_calls"] = [{**tc, "index": i} for i, tc in enumerate(m["tool_calls"])]
        yield {"index": c["index"], "delta": delta, "logprobs": c.get("logprobs"), "finish_reason": None}
        yield {"index": c["index"], "delta": {}, "finish_reason": c["finish_reason"]}


def _text_deltas(choices: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    yield from ({**c, "finish_reason": None} for c in choices)
    for c in choices:
        yield {"index": c["index"], "text": "", "finish_reason": c["finish_reason"], "logprobs": None}
