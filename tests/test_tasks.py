"""The built-in arithmetic task: deterministic, disjoint splits and its rule reward."""

from __future__ import annotations

import json

import pytest

from controller.tasks import BUILTIN_TASKS, get_task, write_splits
from controller.tasks.arithmetic import ArithmeticTask, arithmetic_reward, make_split


def test_make_split_is_deterministic_and_seed_dependent():
    assert make_split("train", 200, seed=3) == make_split("train", 200, seed=3)
    assert make_split("train", 200, seed=3) != make_split("train", 200, seed=4)


# one range that both splits play: the secret is never shown
ONE_GAME = {"guess_number-1to8", "guess_number-1to8-in3", "guess_number-1to8-traces"}


@pytest.mark.parametrize("name", sorted(set(BUILTIN_TASKS) - ONE_GAME))
def test_train_and_val_are_disjoint_for_every_seed(name):
    task = get_task(name)
    # json.dumps: a prompt may be a list of chat messages (the calculator's tool-use traces)
    val = {json.dumps(row["prompt"]) for seed in range(3) for row in task.make_split("val", 300, seed)}
    train = {json.dumps(row["prompt"]) for seed in range(3) for row in task.make_split("train", 2000, seed)}
    assert val and train and not val & train


def test_the_one_range_game_plays_every_secret_in_both_splits():
    for split in ("train", "val"):
        rows = get_task("guess_number-1to8").make_split(split, 200)
        assert {row["prompt"] for row in rows} == {"Guess 1-8."}
        assert {int(row["ground_truth"]) for row in rows} == set(range(1, 9))
        assert all(row["extra"] == {"solve_within": 4} for row in rows)  # binary search's worst case
    rows = get_task("guess_number-1to8-in3").make_split("train", 50)
    assert all(row["extra"] == {"solve_within": 3} for row in rows)


def test_the_one_range_traces_guess_at_random_inside_the_interval_the_hints_leave():
    rows = get_task("guess_number-1to8-traces").make_split("train", 4000)
    first_guesses = []
    for row in rows:
        low, high, turns = 1, 8, row["prompt"][1:]
        for guess, hint in zip(turns[::2], turns[1::2], strict=True):
            assert low <= int(guess["content"]) <= high and hint["content"] in ("higher", "lower")
            low, high = (
                (int(guess["content"]) + 1, high)
                if hint["content"] == "higher"
                else (low, int(guess["content"]) - 1)
            )
        guess = int(row["response"].removesuffix("<|im_end|>"))
        assert low <= guess <= high, row
        assert len(turns) // 2 < 4  # at most the GRPO stage's 4 turns
        if not turns:
            first_guesses.append(guess)
    # uniform, not binary search: every first guess about equally often (1/8 each, ~1300 games)
    shares = [first_guesses.count(g) / len(first_guesses) for g in range(1, 9)]
    assert all(abs(share - 1 / 8) < 0.03 for share in shares), shares


def test_rows_are_distinct_correct_and_answer_only():
    rows = make_split("train", 1000, seed=0)
    assert len({r["prompt"] for r in rows}) == 1000
    for row in rows:
        a, b = row["prompt"].rstrip("=").split("+")
        assert 10 <= int(a) <= 99 and 10 <= int(b) <= 99
        assert row["ground_truth"] == row["response"] == str(int(a) + int(b))


def test_other_operations_and_digits():
    task = ArithmeticTask(digits=1, operations=("-", "*"))
    for row in task.make_split("train", 40, seed=0):
        expression = row["prompt"].rstrip("=")
        assert int(row["ground_truth"]) == eval(expression) >= 0  # "-" keeps answers non-negative
    big = ArithmeticTask(digits=5)  # too large to enumerate: sampled, still disjoint
    assert not {r["prompt"] for r in big.make_split("train", 500)} & {
        r["prompt"] for r in big.make_split("val", 500)
    }


def test_bad_arguments_are_clear():
    with pytest.raises(ValueError, match="split must be"):
        make_split("test", 10)
    with pytest.raises(ValueError, match="has only"):
        make_split("val", 10_000)
    with pytest.raises(ValueError, match="operations"):
        ArithmeticTask(operations=("/",))
    with pytest.raises(ValueError, match="unknown built-in task 'nope'"):
        get_task("nope")


@pytest.mark.parametrize(
    ("response", "score", "fmt"),
    [
        ("81", 1.0, 1.0),
        (" 81 ", 1.0, 1.0),
        ("81<|endoftext|>", 1.0, 1.0),
        ("81<|endoftext|>garbage after the end", 1.0, 1.0),
        ("81+", 1.0, 0.0),  # the answer ends at the first non-answer character
        ("80", 0.0, 1.0),
        ("810", 0.0, 1.0),
        ("", 0.0, 0.0),
        ("<|endoftext|>", 0.0, 0.0),
        ("x81", 0.0, 0.0),
        ("-81", 0.0, 1.0),
    ],
)
def test_reward_on_right_wrong_and_malformed_answers(response, score, fmt):
    assert arithmetic_reward("23+58=", response, "81", None) == {"score": score, "format": fmt}


def test_reward_accepts_numeric_ground_truth():
    assert arithmetic_reward("23+58=", "81", 81, None)["score"] == 1.0


def test_write_splits_round_trip(tmp_path):
    train, val = write_splits("arithmetic", tmp_path, train_size=50, val_size=10, seed=1)
    rows = [json.loads(line) for line in train.read_text().splitlines()]
    assert rows == make_split("train", 50, seed=1)
    assert len(val.read_text().splitlines()) == 10
    assert not list(tmp_path.glob("*.tmp"))
