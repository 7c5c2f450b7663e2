"""`rollout.external.agent`: an agent `fn(client: openai.OpenAI, model, index) -> float | dict` that the
job runs itself, in sandboxes without a network (workers/sandbox/): its client's transport sends each
request over the sandbox's pipe to its `AgentWorker`, which has the job's endpoint answer it over Ray.
The task index repeats `group_size` times (a GRPO group is one task solved that often). `AgentPool`
keeps `agent_workers` calls under way; a call past `agent_timeout_s` has its process replaced, and one
that ended its sandbox (a limit, an exit) leaves the next call a fresh sandbox.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import uuid
from typing import Any

import ray

from controller.agent_sandbox import AgentError
from controller.user_code import run_sandboxed
from schema.external import ExternalSpec
from workers.sandbox.channel import SandboxError, UserCode

log = logging.getLogger("tandem.job")
CALL_TIMEOUT_S = 900.0
START_CHECK_S = 120.0


def _ok(body: dict[str, Any]) -> dict[str, Any]:
    return {"status": 200, "json": body, "headers": {}}


def _error(status: int, message: str, param: str | None, retry_after: float | None = None) -> dict[str, Any]:
    headers = {"retry-after": str(max(1, round(retry_after)))} if retry_after else {}
    return {"status": status, "json": {"error": {"message": message, "param": param}}, "headers": headers}


class AgentWorker(UserCode):
    """Ray actor body: the user's agent in a sandbox of its own, one trajectory per call; the actor
    answers the sandbox's HTTP requests from the job's endpoint, and its death ends the sandbox."""

    def __init__(self, ref: str, server: Any, model: str, args: dict[str, Any] | None = None) -> None:
        self.server, self.model, self.args = server, model, args
        self.trajectory: str | None = None  # the one a call under way records
        self._start(ref)

    def _start(self, ref: str) -> None:
        """The sandbox with the agent loaded: at first, and again after a call ended its process."""
        super().__init__(ref, f"agent '{ref}'", AgentError, "controller.agent_sandbox:check_agent", [self.args],
                         asker=self._ask)  # fmt: skip

    def _ask(self, topic: str, payload: Any) -> dict[str, Any]:
        """{status, json, headers} of the sandbox's OpenAI request, answered by the job's endpoint."""
        if topic != "http" or not isinstance(payload, dict) or self.trajectory is None:
            raise ValueError(f"an agent's sandbox may ask for HTTP during a call only, not {topic!r}")
        path, body_text = str(payload.get("path", "")), str(payload.get("body", ""))
        if path.endswith("/models"):
            return _ok({"object": "list", "data": [{"id": self.model, "object": "model"}]})
        try:
            body = json.loads(body_text or "{}")
        except ValueError:
            return _error(400, "the request body is not JSON", None)
        if not isinstance(body, dict):
            return _error(400, "the request body must be a JSON object", None)
        if body.get("stream"):
            return _error(422, "stream is not served to agents the job runs; leave it off", "stream")
        routes = {"/chat/completions": "chat", "/completions": "completion"}  # the longer suffix first
        method = next((name for suffix, name in routes.items() if path.endswith(suffix)), None)
        if method is None:
            return _error(404, f"no route {path[:200]}", None)
        out = ray.get(self.server.answer.remote(method, self.trajectory, body), timeout=CALL_TIMEOUT_S)
        if "error" in out:
            e = out["error"]
            return _error(e["status"], e["message"], e.get("param"), e.get("retry_after"))
        return _ok(out)

    def run(self, index: int, trajectory: str) -> dict[str, Any]:
        if not self.alive:  # a limit or an exit ended it: else every later call would fail at once
            self.close()
            self._start(self.ref)
        self.trajectory = trajectory
        try:
            args = [self.placed, self.model, index, self.args]
            out = self.call("controller.agent_sandbox:run_in_sandbox", args, CALL_TIMEOUT_S)
        except SandboxError as err:  # its message last: the pool logs the tail of what it raises
            raise AgentError(
                f"agent '{self.ref}' raised {err.type or 'in its sandbox'}: {err.message}"
            ) from None
        finally:
            self.trajectory = None
        if not isinstance(out, dict) or not isinstance(out.get("reward"), int | float):
            raise AgentError(f"agent '{self.ref}' answered {str(out)[:200]}; expected a reward")
        return out  # run_in_sandbox kept the reward and the fields a reward call takes


class AgentPool:
    def __init__(self, config: ExternalSpec, server: Any, model: str) -> None:
        self.ref, self.server, self.model = config.agent, server, model
        self.args, self.timeout_s = config.agent_args, config.agent_timeout_s
        # once, before any worker: an agent that cannot load fails the job here, saying why
        run_sandboxed("controller.agent_sandbox:check_agent", self.ref, [self.args], START_CHECK_S,
                      f"agent '{self.ref}'")  # fmt: skip
        self.group_size, self.workers = config.group_size, config.agent_workers
        self.started = self.finished = self.failed = self.timed_out = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="tandem-agents", daemon=True)
        self._thread.start()

    def _new_worker(self) -> Any:
        worker = ray.remote(AgentWorker).options(num_cpus=0)
        return worker.remote(self.ref, self.server, self.model, self.args)

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
                if self._settle(ref, trajectory):
                    idle.append(worker)
                else:  # its process died: every later call on it would fail at once, the loop spinning
                    ray.kill(worker, no_restart=True)
                    idle.append(self._new_worker())
            for ref, (worker, trajectory, started) in list(running.items()):
                if time.monotonic() - started > self.timeout_s:
                    running.pop(ref)
                    ray.kill(worker, no_restart=True)
                    self.timed_out += 1
                    log.warning("agent %s: the call for %s passed agent_timeout_s=%g s: its process was replaced",
                                self.ref, trajectory, self.timeout_s)  # fmt: skip
                    idle.append(self._new_worker())
        for worker, _, _ in running.values():
            ray.kill(worker, no_restart=True)
        for worker in idle:
            ray.kill(worker, no_restart=True)

    def _settle(self, ref: Any, trajectory: str) -> bool:
        """Count the call's outcome (its reward to the endpoint); False when its worker died."""
        try:
            result = ray.get(ref)
        except Exception as err:  # user code: counted and logged, the job goes on
            self.failed += 1
            log.warning("agent %s failed for %s: %s", self.ref, trajectory, str(err)[-500:])
            return not isinstance(err, ray.exceptions.RayActorError)
        try:
            answer = ray.get(self.server.reward.remote(trajectory, result), timeout=60)
        except Exception as err:  # noqa: BLE001 - the endpoint did not answer: counted, the loop goes on
            answer = {"error": {"message": f"the job's endpoint did not take it: {err}"[:500]}}
        if "error" in answer:
            self.failed += 1
            log.warning(
                "agent %s: reward for %s refused: %s", self.ref, trajectory, answer["error"]["message"]
            )
        else:
            self.finished += 1
        return True

    def stats(self) -> dict[str, float]:
        return {"external/agent_calls_done": float(self.finished), "external/agent_failures": float(self.failed),
                "external/agent_timeouts": float(self.timed_out)}  # fmt: skip

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
