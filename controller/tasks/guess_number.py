"""The built-in guessing game for `builtin:guess_number`: a prompt "Guess 17-32." with the secret as its
ground truth, and in its extra the turns within which a solve earns the full reward (by default
log2(span) + 1, binary search's worst case). With `max_low` 1 both splits play the one range: the
secret is never shown, so validation measures the strategy, not recall.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from controller.tasks.arithmetic import split_of, split_rng


@dataclass(frozen=True)
class GuessNumberTask:
    span: int = 16
    max_low: int = 84
    val_fraction: float = 0.15
    default_train_size: int = 2000
    default_val_size: int = 64
    name: str = "guess_number"
    solve_within: int | None = None  # None: log2(span) + 1

    def make_split(self, split: str, size: int, seed: int = 0) -> list[dict[str, Any]]:
        rng = split_rng(self.name, split, seed)
        lows = [
            low
            for low in range(1, self.max_low + 1)
            if split_of(self._prompt(low), self.val_fraction) == split
        ]
        if self.max_low == 1:
            lows = [1]
        within = self.solve_within or math.ceil(math.log2(self.span)) + 1
        rows = []
        for _ in range(size):
            low = rng.choice(lows)
            secret = rng.randint(low, low + self.span - 1)
            rows.append(
                {"prompt": self._prompt(low), "ground_truth": str(secret), "extra": {"solve_within": within}}
            )
        return rows

    def _prompt(self, low: int) -> str:
        return f"Guess {low}-{low + self.span - 1}."


@dataclass(frozen=True)
class GuessNumberTracesTask:
    """SFT rows of random-guess games, one per turn: the format without the strategy, which RL is left
    to learn. Guesses are uniform in the range, or with `inside_hints` in the interval the hints leave
    (the model learns to read the hints, not to halve the interval)."""

    game: GuessNumberTask = GuessNumberTask()
    turns: int = 3  # at most this many turns of each game
    inside_hints: bool = False
    default_train_size: int = 2000
    default_val_size: int = 64
    name: str = "guess_number-traces"

    def make_split(self, split: str, size: int, seed: int = 0) -> list[dict[str, Any]]:
        rng = split_rng(self.name, split, seed)
        rows: list[dict[str, Any]] = []
        for game in self.game.make_split(split, size, seed):
            low = int(game["prompt"].split()[1].split("-")[0])
            low, high, secret = low, low + self.game.span - 1, int(game["ground_truth"])
            conversation = [{"role": "user", "content": game["prompt"]}]
            for _ in range(self.turns):
                guess = rng.randint(low, high)
                rows.append(
                    {"prompt": list(conversation), "response": f"{guess}<|im_end|>", "ground_truth": ""}
                )
                if guess == secret:
                    break
                hint = "higher" if secret > guess else "lower"
                if self.inside_hints:
                    low, high = (guess + 1, high) if hint == "higher" else (low, guess - 1)
                conversation += [
                    {"role": "assistant", "content": str(guess)},
                    {"role": "user", "content": hint},
                ]
        return rows[:size] if size < len(rows) else rows
