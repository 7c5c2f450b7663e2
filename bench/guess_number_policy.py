"""How a model plays "Guess 1-8.": its strategy, measured by playing games with transformers alone.

For an HF folder (an SFT or GRPO export), play `games` games of the built-in guessing game
(workers/environments/guess_number.py rules: "higher"/"lower" hints) by sampling one token a turn
at temperature 1 from the model's full vocabulary, every secret equally often, and report:
- `inside`: the share of guesses inside the interval the hints leave (a warm start that reads the
  hints is near 1; one that ignores them is near the interval's share of 1-8);
- `first_guess`: how often each first guess was made (a halving strategy opens with 4 or 5);
- `score` and `turns`: the game's reward (1 for a solve within `solve_within` turns, 0.5 later, 0
  without one in `max_turns`) and turns per game, next to `exact_scores`' reference points.

No Ray and no Tandem engine here: a second way to see what GRPO changed.

    .venv/bin/python bench/guess_number_policy.py EXPORT [--games 800]
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from fractions import Fraction
from functools import cache

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

SPAN = 8


@cache
def random_inside_turns(size: int) -> dict[int, Fraction]:
    """P(a game takes k guesses) for a uniform secret in an interval of `size` numbers, every guess
    uniform inside the interval the hints leave."""
    turns: dict[int, Fraction] = {}
    for guess in range(size):
        turns[1] = turns.get(1, Fraction(0)) + Fraction(1, size * size)
        for rest in (guess, size - guess - 1):  # the secret below / above the guess
            for k, p in random_inside_turns(rest).items():
                turns[k + 1] = turns.get(k + 1, Fraction(0)) + p * Fraction(rest, size * size)
    return turns


def score(turns: dict[int, Fraction], solve_within: int, max_turns: int) -> float:
    return float(
        sum(p * (1 if k <= solve_within else Fraction(1, 2)) for k, p in turns.items() if k <= max_turns)
    )


def exact_scores(solve_within: int = 3, max_turns: int = 4) -> dict[str, float]:
    """Expected scores of three policies on 1-8: uniform ignoring the hints, uniform inside the
    interval the hints leave, and binary search (1 + 2 + 4 secrets found at guesses 1-3, one at 4)."""
    ignoring = {k: Fraction(7, 8) ** (k - 1) / 8 for k in range(1, max_turns + 1)}
    binary = {1: Fraction(1, 8), 2: Fraction(2, 8), 3: Fraction(4, 8), 4: Fraction(1, 8)}
    return {
        "ignoring_hints": score(ignoring, solve_within, max_turns),
        "random_inside": score(random_inside_turns(SPAN), solve_within, max_turns),
        "binary_search": score(binary, solve_within, max_turns),
    }


@torch.no_grad()
def play(model_dir: str, games: int = 800, solve_within: int = 3, max_turns: int = 4, seed: int = 0) -> dict:
    """Play `games` games (every secret equally often) and measure the strategy; see the docstring."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    generator = torch.Generator().manual_seed(seed)
    secrets = [1 + i % SPAN for i in range(games)]
    bounds = [[1, SPAN] for _ in secrets]
    messages = [[{"role": "user", "content": f"Guess 1-{SPAN}."}] for _ in secrets]
    solved_at: list[int | None] = [None] * games
    inside = guesses = 0
    first: Counter = Counter()
    for turn in range(1, max_turns + 1):
        live = [i for i in range(games) if solved_at[i] is None]
        for i, answer in zip(
            live, _sample(model, tokenizer, [messages[i] for i in live], generator), strict=True
        ):
            guess = int(answer) if answer.isdigit() else None
            low, high = bounds[i]
            guesses += 1
            inside += guess is not None and low <= guess <= high
            if turn == 1:
                first[answer] += 1
            if guess == secrets[i]:
                solved_at[i] = turn
                continue
            hint = "a number please" if guess is None else "higher" if secrets[i] > guess else "lower"
            if guess is not None:
                bounds[i] = [max(low, guess + 1), high] if hint == "higher" else [low, min(high, guess - 1)]
            messages[i] += [{"role": "assistant", "content": answer}, {"role": "user", "content": hint}]
    rewards = [0.0 if t is None else 1.0 if t <= solve_within else 0.5 for t in solved_at]
    return {
        "model": model_dir,
        "games": games,
        "inside": round(inside / guesses, 3),
        "first_guess": {k: round(v / games, 3) for k, v in sorted(first.items())},
        "first_guess_4_or_5": round((first["4"] + first["5"]) / games, 3),
        "score": round(sum(rewards) / games, 3),
        "turns": round(sum(t or max_turns for t in solved_at) / games, 3),
        "exact": {k: round(v, 3) for k, v in exact_scores(solve_within, max_turns).items()},
    }


def _sample(model, tokenizer, conversations: list[list[dict]], generator: torch.Generator) -> list[str]:
    """One token sampled after each conversation's generation prompt, decoded. Conversations of the
    same token length go through the model together (no padding, so positions stay exact)."""
    texts = [
        tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=False) for c in conversations
    ]
    ids = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in texts]
    answers: list[str] = [""] * len(ids)
    for length in sorted({len(x) for x in ids}):
        rows = [i for i, x in enumerate(ids) if len(x) == length]
        logits = model(input_ids=torch.tensor([ids[i] for i in rows])).logits[:, -1].float()
        tokens = torch.multinomial(torch.softmax(logits, -1), 1, generator=generator)[:, 0]
        for i, token in zip(rows, tokens.tolist(), strict=True):
            answers[i] = tokenizer.decode([token])
    return answers


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("model_dir", nargs="+")
    parser.add_argument("--games", type=int, default=800)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    for model_dir in args.model_dir:
        print(json.dumps(play(model_dir, args.games, seed=args.seed)), flush=True)


if __name__ == "__main__":
    main()
