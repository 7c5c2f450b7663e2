"""Environment references, the built-in environments' rules, and the calculator's safe evaluation."""

from __future__ import annotations

from pathlib import Path

import pytest

from workers.environments import CalculatorEnv, GuessNumberEnv
from workers.environments.base import EnvironmentReferenceError, load_environment_class
from workers.environments.calculator import CalculatorError, evaluate

REPO = Path(__file__).resolve().parents[1]


def test_references_resolve_builtin_module_and_file():
    assert load_environment_class("builtin:calculator") is CalculatorEnv
    assert load_environment_class("tests.multiturn_envs:ScriptedEnv").__name__ == "ScriptedEnv"
    cls = load_environment_class(str(REPO / "examples/my_env.py") + ":RhymeEnv")
    env = cls()
    assert (
        env.reset({"prompt": "cat", "ground_truth": None, "extra": None})
        == "Say a word that rhymes with cat."
    )
    assert env.step("hat")[:3] == (None, 1.0, True)
    assert env.step("dog")[1:3] == (0.0, False)


@pytest.mark.parametrize(
    ("ref", "message"),
    [
        ("calculator", "malformed"),
        ("builtin:chess", "not a built-in; choose one of 'builtin:calculator'"),
        ("no_such_module_xyz:Env", "could not be imported: No module named 'no_such_module_xyz'"),
        ("/nope/env.py:Env", "no such file"),
        ("tests.multiturn_envs:Missing", "no attribute 'Missing'"),
        ("tests.multiturn_envs:NeedsArgs", "constructible without arguments"),
        ("tests.multiturn_envs:BadStep", "step(self) must accept one argument"),
    ],
)
def test_bad_references_say_what_is_wrong(ref, message):
    with pytest.raises(EnvironmentReferenceError, match=None) as err:
        load_environment_class(ref)
    assert message in str(err.value)


def test_the_check_runs_in_a_separate_process():
    from controller.user_code import check_callable

    assert "without arguments" in check_callable("tests.multiturn_envs:NeedsArgs", "environment")
    assert check_callable("tests.multiturn_envs:ScriptedEnv", "environment") is None
    # An environment module that ends its process is reported, not fatal to the caller.
    assert "SystemExit" in check_callable("venv.__main__:main", "environment", 30)


def test_calculator_evaluates_arithmetic_and_nothing_else():
    assert evaluate("347*218") == 75646
    assert evaluate("(12+3)*-2 // 4 % 5") == ((12 + 3) * -2 // 4) % 5
    for bad in ("__import__('os')", "a+1", "2**1000", "[1,2]", "1/0", "9" * 20, "1;2"):
        with pytest.raises(CalculatorError):
            evaluate(bad)
    env = CalculatorEnv()
    env.reset({"prompt": "1+1=", "ground_truth": 2, "extra": None})
    assert env.step("<calc>import os</calc>")[0]["content"].startswith("error:")


def test_guess_number_gives_hints_and_rewards_solving_within_k():
    env = GuessNumberEnv()
    env.reset({"prompt": "Guess 1-32.", "ground_truth": "20", "extra": {"solve_within": 2}})
    assert env.step("16") == ("higher", 0.0, False, {})
    assert env.step("I say 24") == ("lower", 0.0, False, {})
    assert env.step("hmm")[0] == "a number please"
    assert env.step("20")[:3] == (None, 0.5, True)  # solved, but on turn 4 > 2
    env.reset({"prompt": "Guess 1-32.", "ground_truth": "7", "extra": None})
    assert env.step("7")[:3] == (None, 1.0, True)
