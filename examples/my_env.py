"""A complete user environment: the model must say a word that rhymes with the row's prompt.

Use it in a job spec as

    rollout:
      environment: examples/my_env.py:RhymeEnv   # a path on the server, or "my_package.envs:RhymeEnv"
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

from typing import Any


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
