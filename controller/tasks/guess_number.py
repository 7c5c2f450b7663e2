"""The built-in guessing-game task: rows for `builtin:guess_number` (workers/environments/guess_number.py).

A row's prompt states a range of `span` numbers ("Guess 17-32."), its ground truth is the secret
in that range and its extra says within how many turns a solve earns the full reward: by default
log2(span) + 1, the most guesses binary search needs when span is a power of two. Ranges start anywhere in
1..`max_low`; a range belongs to train or val by a stable hash of its prompt, so the splits never
share a game. With `max_low` 1 there is one range ("Guess 1-8."), and both splits play it: the
secret is never shown, so validation measures the policy's strategy, not recall.
"""

from __future__ import annotations

import hashlib
import math
import random
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class GuessNumberTask:
    span: int = 16
    max_low: int = 84
    val_fraction: float = 0.15
    default_train_size: int = 2000
    default_val_size: int = 64
    name: str = "guess_number"
    reward_function: str = "builtin:arithmetic"  # unused: the environment scores the game
    solve_within: int | None = None  # None: log2(span) + 1

    def split_of(self, prompt: str) -> str:
        digest = hashlib.blake2b(prompt.encode(), digest_size=8).digest()
        return "val" if int.from_bytes(digest, "big") / 2**64 < self.val_fraction else "train"

    def make_split(self, split: str, size: int, seed: int = 0) -> list[dict[str, Any]]:
        if split not in ("train", "val"):
            raise ValueError(f"split must be 'train' or 'val', got {split!r}")
        rng = random.Random(f"{self.name}:{split}:{seed}")
        lows = [low for low in range(1, self.max_low + 1) if self.split_of(self._prompt(low)) == split]
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
    """SFT rows of random-guess games, one row per turn: the format (one number per turn) without
    the strategy, so that RL has the strategy left to learn. Each guess is uniform in the prompt's
    range, whatever the hints said; with `inside_hints` it is uniform in the interval the hints
    leave (the secret is higher than every "higher" guess, lower than every "lower" guess), so the
    model learns to read the hints but not to halve the interval."""

    game: GuessNumberTask = GuessNumberTask()
    turns: int = 3  # at most this many turns of each game
    inside_hints: bool = False
    default_train_size: int = 2000
    default_val_size: int = 64
    name: str = "guess_number-traces"
    reward_function: str = "builtin:arithmetic"

    def make_split(self, split: str, size: int, seed: int = 0) -> list[dict[str, Any]]:
        rng = random.Random(f"{self.name}:{split}:{seed}")
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
