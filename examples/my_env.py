"""Two complete user environments: a tutor that lets the model retry a sum (examples/custom_env.yaml
learns with it) and a rhyme game that needs a model which knows words.

Use one in a job spec as

    rollout:
      environment: examples/my_env.py:TutorEnv   # a path on the server, or "my_package.envs:TutorEnv"
      max_turns: 3
      max_response_tokens: 128

The interface (documented in workers/environments/base.py): the class is constructed with no
arguments once per trajectory; `reset(row)` gets the data row {"prompt", "ground_truth", "extra"}
and returns the first user turn (a string, a message, or a list of messages); `step(text)` gets the
model's latest turn as text and returns (observation or None, reward, done, info). Rewards add up
to the trajectory's score. A step that raises or takes longer than rollout.env_step_timeout_s ends
the trajectory with score 0 (counted in multiturn/env_errors and multiturn/env_timeouts).
"""

from __future__ import annotations

import re
from typing import Any

LEADING_INTEGER = re.compile(r"\s*(-?\d+)")


class TutorEnv:
    """Rows of the built-in arithmetic task ({"prompt": "23+58=", "ground_truth": "81"}). The model
    answers; a wrong answer gets "No, try again." and another turn. A right answer scores 1/tries.
    A wrong one scores a little, so that a model which cannot add yet learns the shape of an answer:
    0.1 for starting with an integer and 0.2 for the answer's digits in their places (from the
    units), so that three wrong turns (at most 0.9) never reach one right one."""

    def reset(self, row: dict[str, Any]) -> str:
        self.truth = str(row["ground_truth"]).strip()
        self.tries = 0
        return f"What is {str(row['prompt']).rstrip('=')}?"

    def step(self, assistant_text: str) -> tuple[str | None, float, bool, dict[str, Any]]:
        self.tries += 1
        found = LEADING_INTEGER.match(assistant_text)
        if found and found.group(1) == self.truth:
            return None, 1.0 / self.tries, True, {"solved": True}
        if not found:
            return "No, try again.", 0.0, False, {}
        answer = found.group(1)
        in_place = sum(a == b for a, b in zip(answer[::-1], self.truth[::-1], strict=False)) / len(self.truth)
        return "No, try again.", 0.1 + 0.2 * in_place, False, {}


class RhymeEnv:
    def reset(self, row: dict[str, Any]) -> str:
        self.word = str(row["prompt"]).strip().lower()
        self.tries = 0
        return f"Say a word that rhymes with {self.word}."

    def step(self, assistant_text: str) -> tuple[str | None, float, bool, dict[str, Any]]:
        self.tries += 1
        guess = assistant_text.strip().lower().split()[:1]
        if guess and guess[0] != self.word and guess[0][-2:] == self.word[-2:]:
            return None, 1.0 / self.tries, True, {}
        # Feedback as a user turn; a tool would answer with {"role": "tool", "content": ...}.
        return "No, try another word.", 0.0, False, {"tries": self.tries}
