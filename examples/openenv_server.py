"""Two small OpenEnv environment servers, written with OpenEnv's own server library (openenv-core).

`app` serves a digits game: the model is asked for digits, and each of its two turns earns the share
of its characters that are digits (half a point a turn at most). A random tiny model rarely writes
digits, so the score has room to rise: examples/openenv_digits.yaml learns on it.

`tools_app` serves an MCP environment: its tools are `add(a, b)` and `submit(answer)`; `submit`
ends the episode and scores 1 when the answer is the sum the episode asked for.

Name either in a job spec and the job starts it in a sandbox of its own (no network, a socket shared
with the worker):

    rollout:
      environment: openenv_server.py:app   # or my_package.server:app

or run it yourself and give its address (127.0.0.1 or a node of the service's Ray cluster):

    uvicorn examples.openenv_server:app --host 127.0.0.1 --port 8011
    rollout:
      environment: openenv:http://127.0.0.1:8011
"""

from __future__ import annotations

import uuid
from typing import Any

from fastmcp import FastMCP
from openenv.core.env_server import Action, Environment, Observation, State, create_fastapi_app
from openenv.core.env_server.mcp_environment import MCPEnvironment
from openenv.core.env_server.mcp_types import CallToolAction, CallToolObservation
from pydantic import Field

TURNS = 2


class Say(Action):
    message: str = Field(description="what the model wrote")


class Ask(Observation):
    prompt: str = Field("", description="what the environment says next")


class DigitsEnv(Environment):
    """One episode per connection: asks for digits, scores each turn's share of digits."""

    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self) -> None:
        super().__init__()
        self._state = State(episode_id=None, step_count=0)

    def reset(self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any) -> Ask:
        self._state = State(episode_id=episode_id or uuid.uuid4().hex, step_count=0)
        return Ask(prompt=f"Digits for {kwargs.get('prompt', '')}")

    def step(self, action: Say, timeout_s: float | None = None, **kwargs: Any) -> Ask:
        self._state.step_count += 1
        text = action.message.strip()
        share = sum(c.isdigit() for c in text) / max(len(text), 1)
        done = self._state.step_count >= TURNS
        return Ask(prompt="" if done else "More.", reward=share / TURNS, done=done)

    @property
    def state(self) -> State:
        return self._state


class SumTools(MCPEnvironment):
    """Asks for a sum; the model may call `add`, and answers with `submit`."""

    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self) -> None:
        mcp = FastMCP("sums")

        @mcp.tool
        def add(a: int, b: int) -> int:
            """The sum of two integers."""
            return a + b

        @mcp.tool
        def submit(answer: int) -> str:
            """Give the final answer."""
            return "received"

        super().__init__(mcp)
        self._state, self.terms = State(episode_id=None, step_count=0), (0, 0)

    def reset(self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any) -> Ask:
        self._state = State(episode_id=episode_id or uuid.uuid4().hex, step_count=0)
        self.terms = (17, 25) if seed is None else (seed % 50, seed % 7)
        return Ask(prompt=f"What is {self.terms[0]}+{self.terms[1]}? Use the tools.")

    async def step_async(self, action: Action, timeout_s: float | None = None, **kwargs: Any) -> Observation:
        self._state.step_count += 1
        observation = await super().step_async(action, timeout_s=timeout_s, **kwargs)
        if isinstance(action, CallToolAction) and isinstance(observation, CallToolObservation):
            if action.tool_name == "submit":
                right = action.arguments.get("answer") == sum(self.terms)
                observation.reward, observation.done = float(right), True
        return observation

    def _step_impl(self, action: Action, timeout_s: float | None = None, **kwargs: Any) -> Observation:
        return Ask(prompt="Call a tool.", reward=0.0)

    @property
    def state(self) -> State:
        return self._state


app = create_fastapi_app(DigitsEnv, Say, Ask, max_concurrent_envs=256)
tools_app = create_fastapi_app(SumTools, CallToolAction, CallToolObservation, max_concurrent_envs=256)
