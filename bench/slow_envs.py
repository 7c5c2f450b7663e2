"""A latency-bound environment for bench/async_rl.py: the guessing game whose every step takes 50-500 ms
with a long tail, as a tool call or a sandbox would, with a small format reward (importable by Ray
workers as bench.slow_envs)."""

from __future__ import annotations

import random
import time
from typing import Any

from workers.environments.guess_number import GuessNumberEnv


def step_latency_s(rng: random.Random) -> float:
    """50 ms plus a log-normal delay (median ~60 ms, 1 in 10 over ~250 ms), capped at 500 ms."""
    return min(0.05 + rng.lognormvariate(-2.8, 1.0), 0.5)


class SlowGuessNumber(GuessNumberEnv):
    def reset(self, row: dict[str, Any]) -> str:
        self._rng = random.Random(f"{row['prompt']}|{row['ground_truth']}")
        return super().reset(row)

    def step(self, assistant_text: str) -> tuple[str | None, float, bool, dict[str, Any]]:
        """The game's step after the delay, plus 0.1 for a turn that is a guess (a format reward, so
        that a short run's reward moves)."""
        time.sleep(step_latency_s(self._rng))
        observation, reward, done, info = super().step(assistant_text)
        return observation, reward + (0.1 if observation != "a number please" else 0.0), done, info
