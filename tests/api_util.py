"""A real service for API tests: the Service on the tests' local Ray, served by uvicorn on 127.0.0.1."""

from __future__ import annotations

import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import uvicorn

from api.app import create_app
from api.auth import ensure_admin_token
from api.settings import ServeSettings
from service.service import Service

TERMINAL = ("succeeded", "failed", "cancelled")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class LiveService:
    url: str
    token: str
    service: Service
    server: uvicorn.Server
    thread: threading.Thread

    def client(self, token: str | None = None) -> httpx.Client:
        headers = {"Authorization": f"Bearer {token or self.token}"}
        return httpx.Client(base_url=self.url, headers=headers, timeout=30)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=15)
        self.service.shutdown(timeout_s=60)


def start_service(
    home: Path, poll_s: float = 0.2, settings: ServeSettings | None = None, schedule: bool = True
) -> LiveService:
    """`schedule=False`: the scheduler is not started, so submitted jobs stay queued (for fuzzing)."""
    settings = settings or ServeSettings()
    service = Service(
        home, poll_s=poll_s, quotas=settings.quota_book(), warm_controllers=settings.warm_controllers
    )
    if schedule:
        service.start()
    token = ensure_admin_token(service.store, home).read_text().strip()
    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(create_app(service, settings), host="127.0.0.1", port=port, log_level="warning")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 30
    while time.time() < deadline:
        try:
            if httpx.get(url + ("/readyz" if schedule else "/healthz"), timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    else:
        raise RuntimeError("the test service did not become ready within 30 s")
    return LiveService(url, token, service, server, thread)


def tiny_job(**overrides) -> dict:
    spec = {
        "method": "grpo",
        "model": {"builtin": "tiny-qwen2"},
        "reward": {"function": "tests.reward_fns:digit_reward"},
        "trainer": {"total_steps": 3, "prompts_per_step": 4, "val_every": 0},
        "rollout": {"n": 4, "max_new_tokens": 4},
        "optim": {"lr": 1e-3},
        "checkpoint": {"every": 1, "keep_last": 3, "export_hf": False},
        "metadata": {"suite": "api"},
    }
    for key, value in overrides.items():
        if isinstance(value, dict):
            spec[key] = {**spec.get(key, {}), **value}
        else:
            spec[key] = value
    if spec["rollout"].get("source") == "external":  # agents' trajectories make the step: no n, no prompts
        spec["rollout"].pop("n", None), spec["trainer"].pop("prompts_per_step", None)
    return spec


def wait_for(client: httpx.Client, job_id: str, states: tuple[str, ...], timeout_s: float = 180) -> dict:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        job = client.get(f"/v1/jobs/{job_id}").json()
        if job["status"] in states:
            return job
        time.sleep(0.3)
    raise AssertionError(f"job {job_id} did not reach {states} within {timeout_s}s; last: {job['status']}")


def wait_for_step(client: httpx.Client, job_id: str, step: int, timeout_s: float = 180) -> dict:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        job = client.get(f"/v1/jobs/{job_id}").json()
        if job["step"] >= step or job["status"] in TERMINAL:
            return job
        time.sleep(0.2)
    raise AssertionError(f"job {job_id} did not reach step {step} within {timeout_s}s")
