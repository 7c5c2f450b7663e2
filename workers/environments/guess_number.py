"""The built-in guessing game ("builtin:guess_number"): find a secret number from higher/lower hints.

The secret is the row's ground truth; a correct guess within `solve_within` turns (extra, default 5)
earns 1, later 0.5, so halving the range pays more than guessing at random.
"""

from __future__ import annotations

import re
from typing import Any

from workers.environments.base import prompt_text

_GUESS = re.compile(r"-?\d+")


class GuessNumberEnv:
    def reset(self, row: dict[str, Any]) -> str:
        self.secret = int(row["ground_truth"])
        self.solve_within = int((row.get("extra") or {}).get("solve_within", 5))
        self.turns = 0
        return prompt_text(row["prompt"])

    def step(self, assistant_text: str) -> tuple[str | None, float, bool, dict[str, Any]]:
        self.turns += 1
        match = _GUESS.search(assistant_text)
        if match is None:
            return "a number please", 0.0, False, {}
        guess = int(match.group())
        if guess == self.secret:
            return None, 1.0 if self.turns <= self.solve_within else 0.5, True, {"solved": True}
        return ("higher" if self.secret > guess else "lower"), 0.0, False, {}
