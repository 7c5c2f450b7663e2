"""A latency-bound environment for bench/async_rl.py: the guessing game whose every step takes 50-500 ms
with a long tail, as a tool call or a sandbox would (importable by Ray workers as bench.slow_envs)."""

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
        time.sleep(step_latency_s(self._rng))
        return super().step(assistant_text)
