"""Every example spec in examples/ learns something visible in its own step count.

Each spec is built the way `tandem submit` builds it (relative reward files made absolute; a second
stage gets the first stage's HF export through `--model EXPORT`) and run to its end with the
Trainer on the tests' local Ray. The train reward of its last steps must be clearly above that of
its first steps, or its validation accuracy above its starting point, by about half the rise
measured in bench/RESULTS.md. The demo's pair (sft_arithmetic then grpo_arithmetic) takes ~20
minutes on two cores, the calculator pair about as long, the guessing game's pair ~5.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from api.cli_spec import build_spec
from bench.guess_number_policy import play
from controller.sink import JsonlSink
from controller.trainer import Trainer
from engines.models.pretrained import PACKAGED_MODELS, PackagedModelMissing, packaged_gguf
from tests import test_openai_learning as openai_learning  # not a test_ name: collected once, there
from tests import test_openenv_job as openenv_job
from tests import test_reasoning_gym as reasoning_gym_tests
from tests import test_reasoning_gym_smollm2 as reasoning_gym_smollm2
from tests import test_verifiers as verifiers_learning  # not a test_ name: collected once, there

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"

pytestmark = pytest.mark.slow


@pytest.fixture(autouse=True, scope="module")
def _home(tmp_path_factory):
    with pytest.MonkeyPatch.context() as monkey:  # module scope: the SFT stages below build models too
        monkey.setenv("TANDEM_HOME", str(tmp_path_factory.getbasetemp() / "home"))
        yield


def run_example(name: str, workdir: Path, model: str | None = None, **overrides) -> list[dict]:
    """examples/NAME.yaml as `tandem submit examples/NAME.yaml [--model MODEL]` builds it, run to its end."""
    _, spec = build_spec(str(EXAMPLES / f"{name}.yaml"), model=model)
    sink = JsonlSink(workdir)
    Trainer(spec.merged(overrides), workdir, sink, name=workdir.name).run()
    return sink.history


def series(history: list[dict], key: str) -> list[float]:
    """`key` at every step that reports it, step 0 (validation before training) included."""
    return [r["values"][key] for r in history if r["values"].get(key) is not None]


def rise(history: list[dict], key: str) -> tuple[float, float]:
    """Mean of `key` over the first and over the last third of the steps that report it."""
    values = [r["values"][key] for r in history if r["step"] and r["values"].get(key) is not None]
    third = max(len(values) // 3, 1)
    return sum(values[:third]) / third, sum(values[-third:]) / third


# One-stage examples from random weights whose train reward rises by this much over their steps.
REWARD_RISES = {
    "grpo_tiny": 0.1,
    "custom_reward": 0.1,
    "ppo_critic": 0.1,
    "dapo_tiny": 0.1,
    "custom_env": 0.1,
}


@pytest.mark.parametrize(("name", "margin"), REWARD_RISES.items())
def test_example_reward_rises(ray_cluster, tmp_path, name, margin):
    history = run_example(name, tmp_path, checkpoint={"every": 0, "export_hf": False})
    first, last = rise(history, "critic/score/mean")
    assert last > first + margin, [round(r["values"].get("critic/score/mean", -1), 3) for r in history]


@pytest.fixture(scope="module")
def sft_arithmetic(ray_cluster, tmp_path_factory) -> tuple[Path, list[dict]]:
    """The demo's first stage, run once for both of its tests: (its workdir, its history)."""
    workdir = tmp_path_factory.mktemp("sft_arithmetic")
    return workdir, run_example("sft_arithmetic", workdir)


@pytest.mark.timeout(3600)  # beyond pyproject's 600 s: 500 steps, 2-3 min at load 3-10, ~40 at 17-50
def test_sft_arithmetic_accuracy_rises(sft_arithmetic):
    """Seed 0 measured 0.000 -> 0.402 through the service (bench/RESULTS.md, twice) and 0.000 -> 0.972
    here: the step at which the curve jumps moves with the arithmetic's summation order."""
    accuracy = series(sft_arithmetic[1], "val/accuracy")
    assert accuracy[0] < 0.05 and accuracy[-1] > 0.2, accuracy


def fixed_share(before: float, after: float) -> float:
    """The share of what was wrong before (1 - before) that is right after; 1 if nothing was wrong."""
    return (after - before) / (1 - before) if before < 1 else float(after >= before)


@pytest.mark.timeout(5400)  # the SFT stage when run alone, then 300 GRPO steps: 7 min at load 3-10
def test_grpo_arithmetic_from_the_sft_export_clears_the_readme_bar(sft_arithmetic, tmp_path):
    """The demo's promise: GRPO from the SFT export ends above the README's 0.8 greedy accuracy, and
    gets right at least half of the problems the SFT model got wrong. Seed 0 measured 0.402 -> 0.858
    (0.76 of them) through the service and 0.972 -> 1.000 here; seeds 1 and 2 0.97 and 0.95 of them
    (bench/RESULTS.md). The train reward (sampled, temperature 1) likewise: 0.972 -> 0.998 here."""
    export = sft_arithmetic[0] / "export"
    history = run_example("grpo_arithmetic", tmp_path, model=str(export))
    accuracy = series(history, "val/accuracy")
    assert accuracy[-1] > 0.8 and fixed_share(accuracy[0], accuracy[-1]) > 0.5, accuracy
    first, last = rise(history, "critic/score/mean")
    assert fixed_share(first, last) > 0.5, (first, last)


@pytest.mark.timeout(5400)  # SFT 300 steps then GRPO 60: 8 min at load 6, ~30 under load 20-60
def test_calculator_pair_learns_the_tool_then_raises_the_reward(ray_cluster, tmp_path):
    """sft_calculator.yaml, then grpo_calculator.yaml --model EXPORT. Measured (bench/RESULTS.md): SFT
    loss 4.67 -> 0.036 (recorded as 9.34 -> 0.072 while sft/loss was logged twice over); GRPO
    train reward 0.690 (steps 1-20) -> 0.784 (steps 41-60), greedy val
    accuracy 0.750 -> 0.844 on 64 problems, one tool call per trajectory; 8 min at load 6."""
    sft = run_example("sft_calculator", tmp_path / "sft")
    loss = series(sft, "sft/loss")
    assert loss[0] > 2.5 and loss[-1] < 0.15, loss[::20]  # halves of the thresholds set on the doubled metric
    history = run_example("grpo_calculator", tmp_path / "grpo", model=str(tmp_path / "sft" / "export"))
    accuracy = series(history, "val/accuracy")
    first, last = rise(history, "critic/score/mean")
    assert accuracy[0] > 0.6 and accuracy[-1] >= accuracy[0], accuracy  # the warm start uses the tool
    assert last > first + 0.05, series(history, "critic/score/mean")
    assert series(history, "multiturn/tool_calls/mean")[-1] > 0.9


@pytest.mark.timeout(5400)  # 30 steps of a 135M model: 24 min at load 3-16, 33 at load 30
def test_grpo_smollm2_validation_accuracy_rises(ray_cluster, tmp_path):
    """A real pretrained model: greedy accuracy on 48 held-out stories, measured 0.354 -> 0.562
    (hf rollouts, twice, the same to the last digit) and 0.354 -> 0.750 (vllm) in the 30 steps
    (bench/RESULTS.md). Needs the 'real' extra (`make install-real`); skips without it."""
    try:
        packaged_gguf(PACKAGED_MODELS["smollm2-135m-instruct"])
    except PackagedModelMissing as err:
        pytest.skip(str(err))
    history = run_example("grpo_smollm2", tmp_path)
    accuracy = series(history, "val/accuracy")
    assert len(accuracy) == 4 and accuracy[-1] > accuracy[0] + 0.1, accuracy


@pytest.mark.timeout(3600)  # SFT 300 steps then GRPO 300: 5-9 min at load 1-14 (bench, same setup)
def test_guess_number_pair_learns_a_better_strategy_than_its_warm_start(ray_cluster, tmp_path):
    """sft_guess_number.yaml, then grpo_guess_number.yaml --model EXPORT. The warm start reads the
    hints (most guesses fall inside the interval they leave) but guesses at random there; GRPO must
    raise the score and move the first guess to the middle (4 or 5), measured by playing 800 games
    with each export (bench/guess_number_policy.py). Measured by bench/multiturn_learning.py --env
    guess_number-1to8, this setup, seeds 0/1/2 (bench/RESULTS.md): train reward, first -> last third
    0.621 -> 0.787, 0.694 -> 0.876, 0.474 -> 0.681; played score 0.536 -> 0.823, 0.584 -> 0.914,
    0.464 -> 0.534; first guess 4 or 5 0.26 -> 0.94, 0.28 -> 1.00, 0.28 -> 0.62; share of guesses
    inside the interval after SFT 0.80, 0.84, 0.71. The margins pass for all three seeds; this test
    gave seed 0's figures exactly (4 min 50 s at load 1-3.5)."""
    run_example("sft_guess_number", tmp_path / "sft")
    history = run_example("grpo_guess_number", tmp_path / "grpo", model=str(tmp_path / "sft" / "export"))
    before, after = play(str(tmp_path / "sft" / "export")), play(str(tmp_path / "grpo" / "export"))
    first, last = rise(history, "critic/score/mean")
    assert before["inside"] > 0.6, before  # the warm start reads the hints
    assert last > first + 0.08, series(history, "critic/score/mean")
    assert after["score"] > before["score"] + 0.05, (before, after)
    assert after["first_guess_4_or_5"] > before["first_guess_4_or_5"] + 0.3, (before, after)


# Every example in examples/ and the test above that shows it learning (tests/test_example_specs.py
# fails when an example is missing here).
LEARNING_TESTS = {
    **dict.fromkeys(REWARD_RISES, test_example_reward_rises),
    "sft_arithmetic": test_sft_arithmetic_accuracy_rises,
    "grpo_arithmetic": test_grpo_arithmetic_from_the_sft_export_clears_the_readme_bar,
    "sft_calculator": test_calculator_pair_learns_the_tool_then_raises_the_reward,
    "grpo_calculator": test_calculator_pair_learns_the_tool_then_raises_the_reward,
    "grpo_smollm2": test_grpo_smollm2_validation_accuracy_rises,
    "sft_guess_number": test_guess_number_pair_learns_a_better_strategy_than_its_warm_start,
    "grpo_guess_number": test_guess_number_pair_learns_a_better_strategy_than_its_warm_start,
    # fed by examples/agent_openai.py through the job's OpenAI-compatible endpoint
    "agent_openai": openai_learning.test_a_job_fed_by_the_agent_script_raises_its_reward,
    "openenv_digits": openenv_job.test_the_openenv_example_learns_on_its_server,  # in make test
    "reasoning_gym": reasoning_gym_tests.test_the_example_trains_the_tiny_model_through_the_service,
    "reasoning_gym_smollm2": reasoning_gym_smollm2.test_smollm2_raises_its_reasoning_gym_score,
    # a verifiers environment the job runs itself (tests/test_verifiers.py, make test)
    "verifiers_arithmetic": verifiers_learning.test_the_example_environment_learns,
}
