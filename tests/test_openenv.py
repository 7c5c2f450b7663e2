"""OpenEnv servers as multi-turn environments, without a model: the address rules, the check at
submission, and the client against real servers (examples/openenv_server.py under uvicorn on
127.0.0.1), including MCP tools, a server that hangs and one that answers garbage."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
import uuid
from typing import Any

import pytest
import uvicorn

from schema.workers import EnvironmentConfig
from tests.api_util import free_port, tiny_job
from workers.environments.base import EnvironmentReferenceError
from workers.environments.openenv_client import client_classes
from workers.environments.openenv_ref import openenv_url_problem, openenv_ws_url
from workers.environments.sandboxed import environment_factory, release

client_classes()  # imports openenv.core without its Gradio UI, before the example servers import it

from openenv.core.env_server import Environment, State, create_fastapi_app  # noqa: E402

from examples.openenv_server import Ask, Say, app, tools_app  # noqa: E402

ROW = {"prompt": "23+58=", "ground_truth": "81", "extra": None}


class SlowEnv(Environment):
    """Answers reset, then takes far longer than any step limit to answer a step."""

    SUPPORTS_CONCURRENT_SESSIONS = True

    def reset(self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any) -> Ask:
        return Ask(prompt="go")

    def step(self, action: Say, timeout_s: float | None = None, **kwargs: Any) -> Ask:
        time.sleep(30)
        return Ask(prompt="late")

    @property
    def state(self) -> State:
        return State(episode_id=None, step_count=0)


def serve(asgi: Any) -> str:
    """`asgi` under uvicorn on 127.0.0.1 in a daemon thread; its 'openenv:http://...' reference."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(asgi, host="127.0.0.1", port=port, log_level="error"))
    threading.Thread(target=server.run, daemon=True).start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline, "the test server did not start"
        time.sleep(0.05)
    return f"openenv:http://127.0.0.1:{port}"


@pytest.fixture(scope="module")
def digits() -> str:
    return serve(app)


def env_of(ref: str, timeout_s: float = 10.0) -> Any:
    return environment_factory(EnvironmentConfig(environment=ref, env_step_timeout_s=timeout_s))()


@pytest.mark.parametrize(
    ("url", "words"),
    [
        ("openenv:http://169.254.169.254:80", "neither 127.0.0.1 nor a node"),
        ("openenv:http://10.0.0.7:8000", "neither 127.0.0.1 nor a node"),
        ("openenv:http://metadata.google.internal:80", "is a name"),
        ("openenv:http://user:pw@127.0.0.1:80", "only a scheme, a host and a port"),
        ("openenv:http://127.0.0.1:80/admin", "only a scheme, a host and a port"),
        ("openenv:http://127.0.0.1:80?x=1", "only a scheme, a host and a port"),
        ("openenv:http://127.0.0.1", "port is missing"),
        ("openenv:http://127.0.0.1:99999", "not a URL"),
        ("openenv:file:///etc/passwd", "expected 'openenv:http://HOST:PORT'"),
        ("openenv:http://127.0.0.1:80" + "0" * 400, "longer than"),
    ],
)
def test_an_address_outside_loopback_and_the_cluster_is_refused(url: str, words: str) -> None:
    problem = openenv_url_problem(url, cluster={"127.0.0.1", "10.0.0.2"})
    assert problem is not None and words in problem and url[:40] in problem


def test_loopback_and_cluster_addresses_are_accepted_as_websocket_urls() -> None:
    cluster = {"127.0.0.1", "::1", "10.0.0.2"}
    assert openenv_ws_url("openenv:http://127.0.0.1:8011", cluster) == "ws://127.0.0.1:8011"
    assert openenv_ws_url("openenv:https://localhost:8011/", cluster) == "wss://127.0.0.1:8011"
    assert openenv_ws_url("openenv:ws://10.0.0.2:9", cluster) == "ws://10.0.0.2:9"
    assert openenv_ws_url("openenv:http://[::1]:9", cluster) == "ws://[::1]:9"


def test_submission_names_the_field_for_a_foreign_address_and_takes_a_loopback_one(
    unscheduled, ray_cluster
) -> None:
    """On a service that starts no job (accepted is all this test asks; the cluster's addresses are Ray's)."""
    with unscheduled.client() as api:
        for ref in ("openenv:http://169.254.169.254:80", "openenv:http://example.com:80"):
            response = api.post("/v1/jobs", json=tiny_job(rollout={"environment": ref}))
            assert response.status_code == 422, response.text
            error = response.json()["error"]
            assert error["param"] == "rollout.environment" and ref in error["message"], error
        loopback = tiny_job(rollout={"environment": "openenv:http://127.0.0.1:8011"})
        response = api.post("/v1/jobs", json=loopback)
        assert response.status_code == 201, response.text
        api.post(f"/v1/jobs/{response.json()['id']}/cancel")


def test_reset_and_step_go_to_the_server_with_its_rewards_and_done(digits: str) -> None:
    env = env_of(digits)
    assert env.reset(ROW) == [{"role": "user", "content": "Digits for 23+58="}]
    assert env.step("12ab") == ({"role": "user", "content": "More."}, 0.25, False, {})
    observation, reward, done, _ = env.step("99")
    assert (observation, reward, done) == (None, 0.5, True)
    other = env_of(digits)  # a session of its own: its episode starts afresh
    other.reset(ROW)
    assert other.step("1a") == ({"role": "user", "content": "More."}, 0.25, False, {})
    release([env, other])
    assert env.client is None and other.client is None


def test_mcp_tools_are_listed_to_the_model_and_called_from_its_turns() -> None:
    env = env_of(serve(tools_app))
    system, user = env.reset({**ROW, "extra": {"seed": 3}})
    assert (
        system["role"] == "system"
        and '"name": "add"' in system["content"]
        and "<tool_call>" in system["content"]
    )
    assert user == {"role": "user", "content": "What is 3+3? Use the tools."}
    call = '<tool_call>{"name": "add", "arguments": {"a": 3, "b": 3}}</tool_call>'
    assert env.step(f"let me add {call}") == (
        {"role": "tool", "content": "6"},
        0.0,
        False,
        {"tool_call": True},
    )
    missing = '<tool_call>{"name": "multiply", "arguments": {}}</tool_call>'
    message, reward, done, _ = env.step(missing)
    assert message["role"] == "tool" and "multiply" in message["content"] and (reward, done) == (0.0, False)
    submit = '<tool_call>{"name": "submit", "arguments": {"answer": 6}}</tool_call>'
    assert env.step(submit)[1:3] == (1.0, True)
    again = env_of(serve(tools_app))
    again.reset(ROW)
    assert again.step("the answer is 42") == (None, 0.0, True, {})  # no call: the trajectory ends
    release([env, again])


def test_a_server_that_hangs_fails_within_the_step_limit_naming_the_environment() -> None:
    with socket.socket() as silent:  # accepts connections and never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        ref = f"openenv:http://127.0.0.1:{silent.getsockname()[1]}"
        started = time.monotonic()
        with pytest.raises(EnvironmentReferenceError, match=f"'{ref}' did not answer GET /schema within 1 s"):
            env_of(ref, timeout_s=1.0)
        assert time.monotonic() - started < 5
    slow = serve(create_fastapi_app(SlowEnv, Say, Ask, max_concurrent_envs=4))
    env = env_of(slow, timeout_s=1.0)
    env.reset(ROW)
    started = time.monotonic()
    with pytest.raises(TimeoutError, match=f"'{slow}' did not answer step within 1 s"):
        env.step("12")
    assert time.monotonic() - started < 5
    release([env])


def test_a_server_that_answers_garbage_is_named() -> None:
    async def garbage(scope: dict, receive: Any, send: Any) -> None:
        await send(
            {"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]}
        )
        await send({"type": "http.response.body", "body": uuid.uuid4().hex.encode()})

    ref = serve(garbage)
    with pytest.raises(
        EnvironmentReferenceError, match=f"'{ref}' answered GET /schema with status 200 and no action"
    ):
        env_of(ref)


TWO_TEXTS_REQUIRED_7 = json.dumps({"action": {"properties": {"a": {"type": "string"}, "b": {"type": "string"}},
                                               "required": 7}}).encode()  # fmt: skip


def _schema_answer(chunks: Any, pause_s: float = 0.0) -> Any:
    """An ASGI app answering every request 200 with `chunks` as its body, `pause_s` between them."""

    async def app(scope: dict, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        for chunk in chunks:
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await asyncio.sleep(pause_s)
        await send({"type": "http.response.body", "body": b""})

    return app


@pytest.mark.parametrize(
    ("chunks", "pause_s", "words"),
    [
        ([b" "] * 40, 0.2, "did not answer GET /schema within 1 s"),  # each byte in time, the whole never
        ([b" " * (1 << 20)] * 12, 0.0, "answered GET /schema with more than 8 MB"),
        ([b"[" * 100_000], 0.0, "answered GET /schema with status 200 and no action schema"),
        ([TWO_TEXTS_REQUIRED_7], 0.0, r"its action has fields \['a', 'b'\]"),
    ],
)
def test_a_schema_dripped_huge_nested_or_malformed_is_refused_in_time(chunks, pause_s, words) -> None:
    ref = serve(_schema_answer(chunks, pause_s))
    started = time.monotonic()
    with pytest.raises(EnvironmentReferenceError, match=words):
        env_of(ref, timeout_s=1.0)
    assert time.monotonic() - started < 5


def _answers_errors(message: str) -> Any:
    """An OpenEnv server in protocol: a schema, then every WebSocket message answered as an error."""

    async def app(scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
        elif scope["type"] == "http":
            body = json.dumps({"action": {"properties": {"message": {"type": "string"}}}}).encode()
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": body})
        else:
            await receive()
            await send({"type": "websocket.accept"})
            while (await receive())["type"] == "websocket.receive":
                error = {"type": "error", "data": {"message": message, "code": "E"}}
                await send({"type": "websocket.send", "text": json.dumps(error)})

    return app


def test_a_servers_error_of_megabytes_comes_back_bounded_naming_the_environment() -> None:
    ref = serve(_answers_errors("x" * 5_000_000))
    env = env_of(ref, timeout_s=5.0)
    with pytest.raises(RuntimeError) as raised:
        env.reset(ROW)
    assert f"OpenEnv environment '{ref}' failed reset" in str(raised.value) and len(str(raised.value)) < 1000
    release([env])
