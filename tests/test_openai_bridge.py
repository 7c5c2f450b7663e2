"""The endpoint bridge's own waits: finding a job's endpoint actor is bounded and names the job, and a
job that stops running while a call waits answers it with a 409 naming its state."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import pytest
import ray

from api.errors import APIError
from api.routes import openai_endpoint as openai_bridge
from controller.external import ExternalServer
from schema.external import ExternalSpec, server_name
from service.job_state import JobStatus
from tests.api_util import tiny_job
from tests.test_external_batcher import Replica


def test_an_actor_lookup_that_hangs_is_a_503_naming_the_job(monkeypatch):
    def hanging_lookup(name: str):
        time.sleep(1.0)  # Ray's control store not answering; had the bridge waited, this error would show
        raise AssertionError("the bridge should have stopped waiting")

    monkeypatch.setattr(openai_bridge.ray, "get_actor", hanging_lookup)
    monkeypatch.setattr(openai_bridge, "LOOKUP_TIMEOUT_S", 0.2)
    with pytest.raises(APIError) as caught:
        asyncio.run(openai_bridge.call(None, "job-x", "chat", {}))  # the lookup fails before the job is read
    err = caught.value
    assert err.status == 503
    assert "job-x" in str(err.message) and "not found within" in str(err.message)
    assert "job-x" not in openai_bridge._servers


# A job's lifecycle as its endpoint meets it, on a real service without a scheduler (its job records move
# as a run moves them) and the job's real `ExternalServer` actor: no workers, so a chat call waits in it.
@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> str:
    from engines.models.tiny_models import build_builtin_model

    return str(build_builtin_model("tiny-qwen2-chat", tmp_path_factory.mktemp("models")))


def running_job(live) -> str:
    """An external job whose record says it runs (as its controller sets it), its endpoint not started."""
    spec = tiny_job(model={"builtin": "tiny-qwen2-chat"}, rollout={"source": "external"})
    with live.client() as client:
        created = client.post("/v1/jobs", json=spec)
    assert created.status_code == 201, created.text
    job_id = created.json()["id"]
    assert live.service.store.transition(job_id, (JobStatus.QUEUED,), JobStatus.RUNNING)
    return job_id


def endpoint(job_id: str, model_path: str) -> Any:
    """The job's endpoint actor, named as its trainer names it, up and answering."""
    actor = ray.remote(ExternalServer).options(name=server_name(job_id), num_cpus=0, max_concurrency=100)
    actor = actor.remote(job_id, model_path, ExternalSpec())
    ray.get(actor.stats.remote(), timeout=120)
    return actor


def gone(name: str, within_s: float = 30) -> None:
    """Until the killed actor's name is free (a new run's endpoint is started long after)."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            ray.get_actor(name)
        except ValueError:
            return
        time.sleep(0.1)
    raise AssertionError(f"actor {name} was not gone within {within_s} s")


def post_chat(live, job_id: str, answers: dict) -> threading.Thread:
    def send() -> None:
        with live.client() as client:
            body = {"model": job_id, "messages": [{"role": "user", "content": "1+1="}], "max_tokens": 2}
            url = f"/v1/jobs/{job_id}/openai/trajectories/cut-1/v1/chat/completions"
            answers["chat"] = client.post(url, json=body, timeout=200)

    thread = threading.Thread(target=send)
    thread.start()
    return thread


def answered_409(thread: threading.Thread, answers: dict, state: str, within_s: float = 15) -> None:
    thread.join(within_s)
    assert not thread.is_alive(), f"the call still waited {within_s} s after the job stopped running"
    got = answers["chat"]
    assert got.status_code == 409, got.text
    error = got.json()["error"]
    assert error["code"] == "not_running" and error["param"] == "job_id" and f"is {state}" in error["message"]


def test_a_call_waiting_for_a_starting_endpoint_is_a_409_once_the_job_is_cancelled(ray_cluster, unscheduled):
    job_id, answers = running_job(unscheduled), {}
    thread = post_chat(unscheduled, job_id, answers)
    time.sleep(1.0)  # it waits for the endpoint that the job's workers would start
    assert thread.is_alive()
    unscheduled.service.store.transition(job_id, (JobStatus.RUNNING,), JobStatus.CANCELLING)
    answered_409(thread, answers, "cancelling")


def test_a_resumed_runs_endpoint_is_reached_and_calls_cut_by_a_pause_are_409s(
    ray_cluster, unscheduled, model_path
):
    """One job's two runs: the API keeps a handle to the first run's endpoint, so the first call after a
    resume reached that dead actor (a 503). Then a pause cuts two calls in flight: it stops the rollout
    workers first, and the endpoint answered the call on a stopped one with a 503 rollout_failed (which a
    client retries for ever against a paused job); then the endpoint goes, under the other call. Both
    are 409s naming the state. Replicas stand in for rollout workers busy on cue
    (tests/test_external_batcher.py)."""
    job_id, cut, waiting = running_job(unscheduled), {}, {}
    first = endpoint(job_id, model_path)
    url = f"/v1/jobs/{job_id}/trajectories/probe"
    with unscheduled.client() as client:
        assert client.get(url).status_code == 404  # answered by the endpoint: its handle is kept
        ray.kill(first, no_restart=True)  # paused, resumed: a new run starts a new endpoint
        gone(server_name(job_id))
        second = endpoint(job_id, model_path)  # held: an actor lives while its handle does
        again = client.get(url)
    assert again.status_code == 404 and again.json()["error"]["code"] == "not_found", again.text
    replicas = [Replica.remote(name) for name in ("stopped", "kept")]
    ray.get([r.hold.remote(True) for r in replicas], timeout=60)
    ray.get(second.attach.remote(replicas, 0), timeout=60)
    on_stopped = post_chat(unscheduled, job_id, cut)
    time.sleep(1.0)  # on the first free replica, which holds it
    in_endpoint = post_chat(unscheduled, job_id, waiting)  # waits for its trajectory's first call
    time.sleep(0.5)
    assert on_stopped.is_alive() and in_endpoint.is_alive()
    unscheduled.service.store.transition(job_id, (JobStatus.RUNNING,), JobStatus.PAUSING)
    ray.kill(replicas[0], no_restart=True)  # the pause stops the rollout workers first
    answered_409(on_stopped, cut, "pausing")
    ray.kill(second, no_restart=True)  # then the run's end takes its endpoint with it
    answered_409(in_endpoint, waiting, "pausing")
