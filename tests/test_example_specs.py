"""The examples against the runs that back their stated curves.

The calculator example's two specs (and the guessing game's, bench/multiturn_learning.py --env
guess_number-1to8) are the setup whose learning curve bench/RESULTS.md records:
bench/multiturn_learning.py --env calculator measured it (SFT 300 steps, then GRPO 60 steps), and
tests/test_examples.py runs the two example files and asserts it (slow). What a user submits from
examples/ must be that setup, field for field, apart from labels, stored samples and where
checkpoints go. And every example has a learning test in tests/test_examples.py.
"""

from __future__ import annotations

from pathlib import Path

from api.cli_spec import build_spec
from bench.multiturn_learning import SETUPS, grpo_spec, sft_spec

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
LABELS = ("metadata", "name", "tags", "notes")


def comparable(dump: dict) -> dict:
    dump = {k: v for k, v in dump.items() if k not in LABELS}
    dump["checkpoint"] = {k: v for k, v in dump["checkpoint"].items() if k != "export_hf"}
    dump["trainer"] = {k: v for k, v in dump["trainer"].items() if k != "samples_per_step"}
    return dump


def test_sft_calculator_is_the_benchs_warm_start():
    _, spec = build_spec(str(EXAMPLES / "sft_calculator.yaml"))
    assert comparable(spec.model_dump()) == comparable(sft_spec(SETUPS["calculator"], 300).model_dump())


def test_grpo_calculator_with_the_export_is_the_benchs_grpo_stage(tmp_path):
    export = str(tmp_path / "export")
    _, spec = build_spec(str(EXAMPLES / "grpo_calculator.yaml"), model=export)
    bench = grpo_spec(SETUPS["calculator"], export, steps=60, val_every=10)
    assert spec.model.path == export and spec.model.builtin is None
    assert comparable(spec.model_dump()) == comparable(bench.model_dump())


def test_sft_guess_number_is_the_benchs_warm_start():
    setup = SETUPS["guess_number-1to8"]
    _, spec = build_spec(str(EXAMPLES / "sft_guess_number.yaml"))
    bench = sft_spec(setup, setup["sft_steps"], setup["sft_lr"])
    assert comparable(spec.model_dump()) == comparable(bench.model_dump())


def test_grpo_guess_number_with_the_export_is_the_benchs_grpo_stage(tmp_path):
    setup, export = SETUPS["guess_number-1to8"], str(tmp_path / "export")
    _, spec = build_spec(str(EXAMPLES / "grpo_guess_number.yaml"), model=export)
    bench = grpo_spec(setup, export, setup["grpo_steps"], val_every=50, lr=setup["grpo_lr"])
    assert spec.model.path == export and spec.model.builtin is None
    assert comparable(spec.model_dump()) == comparable(bench.model_dump())


def test_every_example_has_a_learning_test():
    """A new example is not done until tests/test_examples.py runs it and asserts what it learns."""
    from tests import test_examples

    examples = sorted(path.stem for path in EXAMPLES.glob("*.yaml"))
    missing = [name for name in examples if name not in test_examples.LEARNING_TESTS]
    assert not missing, (
        f"examples without a learning test in tests/test_examples.py LEARNING_TESTS: {missing}"
    )
    assert sorted(test_examples.LEARNING_TESTS) == examples  # and none listed that is gone
