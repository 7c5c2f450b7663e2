"""A Tinker session's host holds a CPU for as long as the service runs, and the scheduler counts it: on
a 2-CPU service an RL job submitted after a session waits queued, saying what it needs and what holds
the CPUs, rather than being started on a cluster that cannot place it. One real `tandem serve`."""

from __future__ import annotations

import secrets
import tempfile
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.serve_util import (
    BIN,
    Served,
    cluster_env,
    free_ports,
    kill_leftovers,
    start_logged,
    stop,
    wait_ready,
)

BASE = "tiny-qwen2"
JOB = {  # default resources: on 2 CPUs, one worker of 2 CPUs
    "method": "grpo",
    "model": {"builtin": BASE},
    "data": {"builtin_task": "arithmetic"},
    "reward": {"function": "builtin:arithmetic_partial"},
    "rollout": {"n": 4, "max_new_tokens": 4},
    "trainer": {"total_steps": 2, "prompts_per_step": 4},
}


@pytest.fixture(scope="module")
def two_cpus(tmp_path_factory) -> Iterator[Served]:
    root, token = tmp_path_factory.mktemp("held-cpus"), secrets.token_hex(16)
    ray_tmp = tempfile.mkdtemp(prefix="held-ray-")  # short: Ray's socket paths must fit 107 bytes
    (port,) = free_ports(1)
    url, log = f"http://127.0.0.1:{port}", root / "serve.log"
    args = [str(BIN / "tandem"), "serve", "--port", str(port), "--home", str(root / "home"),
            "--num-cpus", "2", "--base-model", BASE]  # fmt: skip
    process = start_logged(args, {**cluster_env(ray_tmp), "TANDEM_ADMIN_TOKEN": token}, log)
    try:
        wait_ready(process, url, log, 240)
        yield Served(url, token, root / "home", process, log)
    finally:
        stop(process, 120)
        kill_leftovers(ray_tmp)


def open_tinker_run(api: httpx.Client) -> None:
    """A session and a LoRA training client on BASE: its host starts and holds 1 CPU."""
    session = api.post("/api/v1/create_session", json={"tags": []}).json()["session_id"]
    body = {"session_id": session, "model_seq_id": 0, "base_model": BASE, "lora_config": {"rank": 4}}
    request = api.post("/api/v1/create_model", json=body).json()["request_id"]
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        result = api.post("/api/v1/retrieve_future", json={"request_id": request}, timeout=60).json()
        if result.get("type") != "try_again":
            assert "model_id" in result, result
            return
    raise AssertionError("the Tinker training client was not created within 300 s")


def test_an_rl_job_after_a_tinker_session_waits_queued_saying_what_holds_the_cpus(two_cpus: Served) -> None:
    with two_cpus.client() as api:
        open_tinker_run(api)
        job = api.post("/v1/jobs", json=JOB).json()["id"]
        waiting, deadline = [], time.monotonic() + 60
        while not waiting and time.monotonic() < deadline:
            assert api.get(f"/v1/jobs/{job}").json()["status"] == "queued"
            events = api.get(f"/v1/jobs/{job}/events").json()["data"]
            waiting = [e for e in events if e["kind"] == "waiting"]
            time.sleep(0.5)
        assert waiting, f"no `waiting` event within 60 s: {events}\n{two_cpus.log_tail()}"
        message = waiting[0]["message"]
        assert "needs 2 CPUs and 0 GPUs; 1 CPUs and 0 GPUs are free" in message, message
        assert f"session host '{BASE}': 1 CPUs" in message, message
        time.sleep(5)  # the scheduler polls every 0.3 s: it had every chance to start it
        assert api.get(f"/v1/jobs/{job}").json()["status"] == "queued"
        assert [e["kind"] for e in api.get(f"/v1/jobs/{job}/events").json()["data"]] == ["created", "waiting"]
        assert api.post(f"/v1/jobs/{job}/cancel").json()["status"] == "cancelled"
