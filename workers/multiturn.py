"""Multi-turn rollouts: per turn one batched `generate` over the live trajectories, then their
environments stepped concurrently, each with a time limit; observations are appended as token deltas
(chat_serving.py). `trajectory_tensors` lays them out as single-turn rollouts are (rollout_layout.py),
response_mask 1 on sampled tokens only. A trajectory its environment failed (ENV_FAILURES: it raised, hung,
answered outside the interface or past the prompt width) is not scored (SCORED False, its reward a 0.0
placeholder): the failure is the environment's, not the policy's, so it neither trains nor moves its
group's baseline (controller/step_math.py).
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Any

import torch
from tensordict import TensorDict

from engines.rollout import RolloutEngine, SamplingParams
from engines.training.base import SCORED
from schema.workers import EnvironmentConfig
from workers.chat_serving import ChatDelta
from workers.environments.base import EnvironmentContractError, StepResult, as_messages
from workers.environments.sandboxed import environment_factory, release
from workers.rollout_layout import layout, place_rows

TRUNCATED = ("max_turns", "budget")
ENV_FAILURES = ("env_error", "env_timeout")
MAX_CHARS_PER_TOKEN = 64


@dataclass
class Trajectory:
    """One conversation: the first prompt's tokens, then everything after it with its loss mask."""

    env: Any
    prompt_ids: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)  # 1 sampled, 0 observation / template
    log_probs: list[float] = field(default_factory=list)
    messages: list[dict[str, str]] = field(default_factory=list)
    reward: float = 0.0
    finish_reason: str | None = None  # done | max_turns | budget | env_error | env_timeout
    turns: int = 0
    tool_calls: int = 0
    weight_version: int = 0
    error: str = ""

    def append(self, ids: list[int], sampled: bool, log_probs: list[float] | None = None) -> None:
        self.tokens += ids
        self.loss_mask += [int(sampled)] * len(ids)
        self.log_probs += log_probs if log_probs is not None else [0.0] * len(ids)

    def fail(self, reason: str, error: str) -> None:
        self.finish_reason, self.reward, self.error = reason, 0.0, error


class MultiTurnRollout:
    def __init__(self, engine: RolloutEngine, delta: ChatDelta, config: EnvironmentConfig) -> None:
        self.engine, self.delta, self.config = engine, delta, config
        self.env_class = environment_factory(config)  # a built-in's class, or a sandbox's proxies

    def run(self, rows: list[dict[str, Any]], params: SamplingParams, prompt_width: int) -> list[Trajectory]:
        trajectories = [Trajectory(env=None) for _ in rows]
        pool = ThreadPoolExecutor(max_workers=min(self.config.threads, max(len(rows), 1)))
        try:
            self._reset(pool, trajectories, rows, prompt_width)
            turn = 0
            while live := [t for t in trajectories if t.finish_reason is None]:
                self._generate(live, params, turn)
                self._step(pool, [t for t in live if t.finish_reason is None])
                turn += 1
        finally:
            pool.shutdown(wait=False, cancel_futures=True)  # a hung step must not hold the worker
            release([t.env for t in trajectories])
        return trajectories

    def _reset(
        self, pool: ThreadPoolExecutor, trajectories: list[Trajectory], rows: list, width: int
    ) -> None:
        def reset(traj: Trajectory, row: dict[str, Any]) -> list[dict[str, str]]:
            traj.env = self.env_class()  # kept before reset runs: one that fails is released too
            messages = as_messages(traj.env.reset(row))
            if not messages:
                raise EnvironmentContractError(
                    "reset() returned no messages: the conversation needs a first turn"
                )
            return messages

        deadline = time.monotonic() + self.config.env_step_timeout_s
        futures = [pool.submit(reset, traj, row) for traj, row in zip(trajectories, rows, strict=True)]
        for traj, future in zip(trajectories, futures, strict=True):
            outcome, ids = self._result(traj, future, deadline), None
            if outcome is not None:
                traj.messages = outcome
                if _too_long(traj.messages, width):  # not tokenized: megabytes would take seconds
                    traj.fail("env_error", f"the environment's first observation ({len(outcome)} messages, "
                              f"{sum(len(m['content']) for m in outcome)} characters) is longer than "
                              f"data.max_prompt_length={width} tokens")  # fmt: skip
                else:
                    ids = self._rendered(traj, self.delta.prompt_ids, traj.messages)
            if ids is not None and len(ids) > width:
                traj.fail("env_error", f"the environment's first observation is {len(ids)} tokens, longer "
                          f"than data.max_prompt_length={width}")  # fmt: skip
            if ids is None or traj.finish_reason is not None:  # a failed one still takes a row of the batch
                ids = self.delta.prompt_ids([{"role": "user", "content": ""}])
            traj.prompt_ids = ids

    def _generate(self, live: list[Trajectory], params: SamplingParams, turn: int) -> None:
        budget = self.config.max_response_tokens
        left = [budget - len(t.tokens) for t in live]
        turn_params = params.model_copy(
            update={
                "max_new_tokens": min(params.max_new_tokens, max(left)),
                "stop_token_ids": sorted({*params.stop_token_ids, *self._turn_end()}),
                "seed": None if params.seed is None else params.seed + 104_729 * turn,
            }
        )
        completions = self.engine.generate([t.prompt_ids + t.tokens for t in live], turn_params)
        for traj, room, comp in zip(live, left, completions, strict=True):
            ids, lps = list(comp.token_ids[:room]), list(comp.log_probs[:room])
            traj.append(ids, sampled=True, log_probs=lps)
            traj.weight_version = comp.weight_version
            traj.turns += 1
            traj.messages.append({"role": "assistant", "content": self.delta.assistant_text(ids)})
            if len(comp.token_ids) > room or (len(traj.tokens) >= budget and comp.finish_reason == "length"):
                traj.finish_reason = "budget"

    def _turn_end(self) -> list[int]:
        return [] if self.delta.turn_end_id is None else [self.delta.turn_end_id]

    def _step(self, pool: ThreadPoolExecutor, live: list[Trajectory]) -> None:
        deadline = time.monotonic() + self.config.env_step_timeout_s
        futures = [pool.submit(_step_env, t.env, t.messages[-1]["content"]) for t in live]
        for traj, future in zip(live, futures, strict=True):
            result = self._result(traj, future, deadline)
            if result is None:
                continue
            traj.reward += result.reward
            traj.tool_calls += int(bool(result.info.get("tool_call")))
            if result.done or not result.messages:
                traj.finish_reason = "done"
            elif traj.turns >= self.config.max_turns:
                traj.finish_reason = "max_turns"
            elif _too_long(result.messages, self.config.max_response_tokens - len(traj.tokens)):
                traj.finish_reason = "budget"  # not tokenized: megabytes would take seconds
            else:
                last = traj.tokens[-1] if traj.tokens else None
                ids = self._rendered(traj, self.delta.observation_ids, result.messages, last)
                if ids is None:
                    continue
                if len(traj.tokens) + len(ids) >= self.config.max_response_tokens:
                    traj.finish_reason = "budget"  # no room left for another assistant token
                    continue
                traj.append(ids, sampled=False)
                traj.messages += result.messages

    def _rendered(self, traj: Trajectory, render: Any, *args: Any) -> Any:
        """The environment's messages through the chat template, or None after failing the trajectory."""
        try:
            return render(*args)
        except Exception as exc:  # the template refused what the environment answered
            traj.fail("env_error", f"the chat template could not render the observation: {exc}"[:500])
            return None

    def _result(self, traj: Trajectory, future: Future, deadline: float) -> Any:
        """The call's value, or None after marking the trajectory failed; all of a turn's calls start
        together, so one deadline is each call's limit."""
        try:
            return future.result(timeout=max(0.0, deadline - time.monotonic()))
        except FutureTimeout:
            traj.fail("env_timeout", f"no answer within {self.config.env_step_timeout_s} s")
        except Exception as exc:  # user code: any failure ends this trajectory only
            traj.fail("env_error", f"{type(exc).__name__}: {exc}")
        return None


def _too_long(messages: list[dict[str, str]], room: int) -> bool:
    """Whether messages cannot fit `room` tokens: each costs a token at least, and no usual
    tokenizer's tokens average more than MAX_CHARS_PER_TOKEN characters."""
    return len(messages) > room or sum(len(m["content"]) for m in messages) > MAX_CHARS_PER_TOKEN * room


def _step_env(env: Any, text: str) -> StepResult:
    return StepResult.from_return(env.step(text))


def trajectory_tensors(
    trajectories: list[Trajectory], prompt_width: int, response_width: int, pad: int
) -> TensorDict:
    tensors = layout(
        [t.prompt_ids for t in trajectories],
        [t.tokens for t in trajectories],
        [t.log_probs for t in trajectories],
        prompt_width,
        response_width,
        pad,
    )
    response_mask = torch.zeros(len(trajectories), response_width, dtype=torch.long)
    place_rows(response_mask, [t.loss_mask for t in trajectories])
    return TensorDict(
        {
            **tensors,
            "response_mask": response_mask,
            "weight_version": torch.tensor([t.weight_version for t in trajectories], dtype=torch.long),
            "env_rewards": torch.tensor([t.reward for t in trajectories], dtype=torch.float32),
            "num_turns": torch.tensor([t.turns for t in trajectories], dtype=torch.long),
            "tool_calls": torch.tensor([t.tool_calls for t in trajectories], dtype=torch.long),
            # 1 where the turn or token budget ended the trajectory (over-long handling reads it).
            "truncated": torch.tensor([t.finish_reason in TRUNCATED for t in trajectories], dtype=torch.long),
            SCORED: torch.tensor(
                [t.finish_reason not in ENV_FAILURES for t in trajectories], dtype=torch.bool
            ),
        },
        batch_size=[len(trajectories)],
    )


def trajectory_non_tensors(trajectories: list[Trajectory]) -> dict[str, list[Any]]:
    return {
        "finish_reason": [t.finish_reason for t in trajectories],
        "messages": [t.messages for t in trajectories],
        "env_error": [t.error for t in trajectories],
    }
