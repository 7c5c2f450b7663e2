"""`rollout.external.agent`: an agent the job runs itself, in worker processes, with a time limit.

The agent is a plain function written against the `openai` SDK:

    def agent(client: openai.OpenAI, model: str, index: int) -> float | dict: ...

It gets a client whose every call is recorded in a fresh trajectory, the model name to pass, and the
task index (the same index `group_size` times in a row, so a GRPO group is one task solved
`group_size` times); it returns the reward, or {"reward", "task_id"?, "turn_rewards"?, "metadata"?}.
The client talks to the job's endpoint actor (controller/external.py) over Ray through an httpx
transport, not over HTTP: the job needs neither the service's address nor a key. `AgentPool` keeps
`agent_workers` calls under way in `AgentWorker` actors; a call past `agent_timeout_s` has its
process killed and replaced (its trajectory is dropped by the reward timeout), an exception is
counted and logged. User code never runs in the API or the controller's process.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import uuid
from typing import Any

import httpx
import ray

from controller.external_spec import load_agent_fn

log = logging.getLogger("tandem.job")
CALL_TIMEOUT_S = 900.0


class EndpointTransport(httpx.BaseTransport):
    """The OpenAI routes of one trajectory, answered by the job's `ExternalServer` over Ray."""

    def __init__(self, server: Any, trajectory: str, model: str) -> None:
        self.server, self.trajectory, self.model = server, trajectory, model

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        if path.endswith("/models"):
            return httpx.Response(
                200, json={"object": "list", "data": [{"id": self.model, "object": "model"}]}
            )
        body = json.loads(request.read() or b"{}")
        if body.get("stream"):
            return _error(422, "stream is not served to agents the job runs; leave it off", "stream")
        method = (
            "chat"
            if path.endswith("/chat/completions")
            else "completion"
            if path.endswith("/completions")
            else None
        )
        if method is None:
            return _error(404, f"no route {path}", None)
        out = ray.get(getattr(self.server, method).remote(self.trajectory, body), timeout=CALL_TIMEOUT_S)
        if "error" in out:
            e = out["error"]
            return _error(e["status"], e["message"], e.get("param"), e.get("retry_after"))
        return httpx.Response(200, json=out)


def _error(status: int, message: str, param: str | None, retry_after: float | None = None) -> httpx.Response:
    headers = {"retry-after": str(max(1, round(retry_after)))} if retry_after else {}
    return httpx.Response(status, json={"error": {"message": message, "param": param}}, headers=headers)


class AgentWorker:
    """Ray actor body: runs the user's agent function, one trajectory per call."""

    def __init__(self, ref: str, server_name: str, model: str) -> None:
        self.fn, self.model = load_agent_fn(ref), model
        self.server = ray.get_actor(server_name)

    def run(self, index: int, trajectory: str) -> dict[str, Any]:
        from openai import OpenAI

        transport = EndpointTransport(self.server, trajectory, self.model)
        client = OpenAI(base_url="http://tandem-job/v1", api_key="in-job", max_retries=10,
                        http_client=httpx.Client(transport=transport))  # fmt: skip
        out = self.fn(client, self.model, index)
        result = out if isinstance(out, dict) else {"reward": out}
        return {
            "reward": float(result["reward"]),
            **{k: result[k] for k in ("task_id", "turn_rewards", "metadata") if k in result},
        }


class AgentPool:
    """Keeps `agent_workers` agent calls under way while the job runs; see the module docstring."""

    def __init__(self, ref: str, server: Any, server_name: str, model: str, workers: int, timeout_s: float,
                 group_size: int) -> None:  # fmt: skip
        self.ref, self.server, self.server_name, self.model = ref, server, server_name, model
        self.timeout_s, self.group_size, self.workers = timeout_s, group_size, workers
        self.started = self.finished = self.failed = self.timed_out = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="tandem-agents", daemon=True)
        self._thread.start()

    def _new_worker(self) -> Any:
        return ray.remote(AgentWorker).options(num_cpus=0).remote(self.ref, self.server_name, self.model)

    def _loop(self) -> None:
        idle = [self._new_worker() for _ in range(self.workers)]
        running: dict[Any, tuple[Any, str, float]] = {}  # ref -> (worker, trajectory, started)
        while not self._stop.is_set():
            while idle:
                worker, index = idle.pop(), self.started // self.group_size
                trajectory = f"agent-{index}-{uuid.uuid4().hex[:8]}"
                running[worker.run.remote(index, trajectory)] = (worker, trajectory, time.monotonic())
                self.started += 1
            done, _ = ray.wait(list(running), num_returns=1, timeout=0.5)
            for ref in done:
                worker, trajectory, _ = running.pop(ref)
                idle.append(worker)
                self._settle(ref, trajectory)
            for ref, (worker, trajectory, started) in list(running.items()):
                if time.monotonic() - started > self.timeout_s:
                    running.pop(ref)
                    ray.kill(worker, no_restart=True)
                    self.timed_out += 1
                    log.warning("agent call for %s passed agent_timeout_s=%g s: its process was replaced",
                                trajectory, self.timeout_s)  # fmt: skip
                    idle.append(self._new_worker())
        for worker, _, _ in running.values():
            ray.kill(worker, no_restart=True)
        for worker in idle:
            ray.kill(worker, no_restart=True)

    def _settle(self, ref: Any, trajectory: str) -> None:
        try:
            result = ray.get(ref)
        except Exception as err:  # user code: counted and logged, the job goes on
            self.failed += 1
            log.warning("agent %s failed for %s: %s", self.ref, trajectory, str(err)[-500:])
            return
        answer = ray.get(self.server.reward.remote(trajectory, result), timeout=60)
        if "error" in answer:
            self.failed += 1
            log.warning(
                "agent %s: reward for %s refused: %s", self.ref, trajectory, answer["error"]["message"]
            )
        else:
            self.finished += 1

    def stats(self) -> dict[str, float]:
        return {"external/agent_calls_done": float(self.finished), "external/agent_failures": float(self.failed),
                "external/agent_timeouts": float(self.timed_out)}  # fmt: skip

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
