"""Rule rewards: the built-ins, loading user functions by reference, and scoring batches."""

from __future__ import annotations

import math
import os
import textwrap
import threading

import pytest
import torch

from controller.rewards import RewardFunctionError, RewardScorer, load_reward_fn

USER_MODULE = """
import math

def score(prompt, response, ground_truth, extra):
    return {"score": float(response == ground_truth), "length": len(response), "note": "not a number"}

def with_default(prompt, response, ground_truth, extra=None, scale=2.0):
    return scale * float(response == ground_truth)

def flaky(prompt, response, ground_truth, extra):
    if response == "boom":
        raise RuntimeError("bad sample")
    return 1.0

def odd_returns(prompt, response, ground_truth, extra):
    return {"nan": math.nan, "str": "yes", "none": None, "nokey": {"value": 1.0}}.get(response, 0.5)

def two_args(a, b):
    return 0.0

not_callable = 42

class Scorer:
    pass
"""


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    """An importable module `tandem_user_rewards` (on sys.path, as a pip-installed one would be, and on
    PYTHONPATH, which sandboxes see read-only)."""
    (tmp_path / "tandem_user_rewards.py").write_text(USER_MODULE)
    tmp_path.chmod(0o755)  # pytest makes it 0700: a sandbox's uid could not read it
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    return "tandem_user_rewards"


# ---- built-ins --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("ref", "response", "truth", "expected"),
    [
        ("builtin:exact_match", " Paris\n", "Paris", 1.0),
        ("builtin:exact_match", "paris", "Paris", 0.0),
        ("builtin:numeric_match", "so the total is 1,234.0 dollars", 1234, 1.0),
        ("builtin:numeric_match", "first 3, then 4", "4", 1.0),  # the last number counts
        ("builtin:numeric_match", "first 4, then 3", "4", 0.0),
        ("builtin:numeric_match", "-0.5", "-0.5000000001", 1.0),
        ("builtin:numeric_match", "no number here", "4", 0.0),
        ("builtin:math_verify", "The answer is \\boxed{1/2}", "0.5", 1.0),
        ("builtin:math_verify", "\\boxed{0.5}", "\\frac{1}{2}", 1.0),
        ("builtin:math_verify", "The answer is \\boxed{1/3}", "0.5", 0.0),
        ("builtin:math_verify", "I do not know", "0.5", 0.0),
        ("builtin:format_boxed", "so \\boxed{x^{2}} done", None, 1.0),
        ("builtin:format_boxed", "so \\boxed{} done", None, 0.0),
        ("builtin:format_boxed", "so \\boxed{x^{2} done", None, 0.0),
        ("builtin:format_boxed", "the answer is 4", None, 0.0),
        ("builtin:arithmetic", "81<|endoftext|>", "81", {"score": 1.0, "format": 1.0}),
        ("builtin:arithmetic", "18", "81", {"score": 0.0, "format": 1.0}),
        # partial credit: 0.1 for a leading number, 0.1 for nothing after it, 0.3 x digits in place
        (
            "builtin:arithmetic_partial",
            "81<|endoftext|>",
            "81",
            {"score": 1.0, "format": 1.0, "correct": 1.0},
        ),
        ("builtin:arithmetic_partial", "71", "81", {"score": 0.35, "format": 1.0, "correct": 0.0}),
        ("builtin:arithmetic_partial", "1+x", "81", {"score": 0.25, "format": 0.0, "correct": 0.0}),
        ("builtin:arithmetic_partial", "18", "81", {"score": 0.2, "format": 1.0, "correct": 0.0}),
        ("builtin:arithmetic_partial", "x81", "81", {"score": 0.0, "format": 0.0, "correct": 0.0}),
    ],
)
def test_builtin_rewards(ref, response, truth, expected):
    assert load_reward_fn(ref)("prompt", response, truth, None) == expected


def test_numeric_match_tolerance_from_extra():
    fn = load_reward_fn("builtin:numeric_match")
    assert fn("", "3.14", "3.14159", None) == 0.0
    assert fn("", "3.14", "3.14159", {"abs_tol": 0.01}) == 1.0


def test_math_verify_works_off_the_main_thread():
    # math-verify's own timeouts use signal.alarm, which raises off the main thread.
    fn, out = load_reward_fn("builtin:math_verify"), []
    thread = threading.Thread(target=lambda: out.append(fn("", "\\boxed{1/2}", "0.5", None)))
    thread.start()
    thread.join(timeout=60)
    assert out == [1.0]


# ---- user functions and bad references --------------------------------------------------------


def test_user_function_from_module_logs_its_extra_metrics(user_module):
    scorer = RewardScorer(f"{user_module}:score")
    result = scorer.score(["p"] * 3, ["a", "bb", "c"], ["a", "bb", "x"], None)
    assert result.scores.tolist() == [1.0, 1.0, 0.0]
    assert result.metrics["reward/length/mean"] == pytest.approx(4 / 3)
    assert "reward/note/mean" not in result.metrics  # non-numeric extras are not logged
    assert result.metrics["reward/errors"] == 0.0 and result.errors == 0


def test_user_function_from_file_path(tmp_path, monkeypatch):
    path = tmp_path / "sub" / "my_rewards.py"
    path.parent.mkdir()
    path.write_text(USER_MODULE)
    monkeypatch.chdir(tmp_path)
    for ref in (f"{path}:with_default", "sub/my_rewards.py:with_default"):
        assert load_reward_fn(ref)("p", "x", "x", None) == 2.0
    # The API process lives long: an edited file is read again on the next load.
    path.write_text("def with_default(prompt, response, ground_truth, extra):\n    return 3.0\n")
    assert load_reward_fn(f"{path}:with_default")("p", "x", "x", None) == 3.0


def test_raising_function_scores_zero_for_that_sample_only(user_module):
    result = RewardScorer(f"{user_module}:flaky").score(["p"] * 4, ["a", "boom", "b", "c"], [None] * 4)
    assert result.scores.tolist() == [1.0, 0.0, 1.0, 1.0]
    assert result.errors == 1 and result.metrics["reward/errors"] == 1.0
    assert result.error_messages == ["sample 1: RuntimeError: bad sample"]


def test_non_numbers_and_nan_count_as_errors(user_module):
    responses = ["nan", "str", "none", "nokey", "fine"]
    result = RewardScorer(f"{user_module}:odd_returns").score(["p"] * 5, responses, [None] * 5)
    assert result.scores.dtype == torch.float32
    assert result.scores.tolist() == [0.0, 0.0, 0.0, 0.0, 0.5]
    assert result.errors == 4 and not any(math.isnan(s) for s in result.scores.tolist())


HOSTILE_RETURNS = """
class EvilFloat(float):
    def __float__(self):
        raise RuntimeError("evil float")

class Mute(Exception):
    def __str__(self):
        raise RuntimeError("no message")

def score(prompt, response, ground_truth, extra):
    if response == "mute":
        raise Mute()
    return {
        "huge_int": 10**400,
        "past_float32": 1e39,
        "evil_float": EvilFloat(1.0),
        "mixed_keys": {1: 2.0, "a": 3.0},
        "many_metrics": {"score": 1.0, **{f"m{i}": 1.0 for i in range(100_000)}},
        "tuple_key": {"score": 0.5, (1, 2): 3.0},
    }.get(response, 1.0)
"""


def test_hostile_returns_fail_their_own_row_and_never_reach_the_scores_as_inf(tmp_path):
    path = tmp_path / "hostile_rewards.py"
    path.write_text(HOSTILE_RETURNS)
    responses = [
        "ok",
        "huge_int",
        "past_float32",
        "evil_float",
        "mixed_keys",
        "many_metrics",
        "mute",
        "tuple_key",
    ]
    with RewardScorer(f"{path}:score") as scorer:  # one sandbox: a row's failure must not be its batch's
        result = scorer.score(["p"] * 8, responses, [None] * 8)
        alone = scorer.score(["p"], ["past_float32"], [None])  # finite here, inf once in float32
    assert alone.scores.tolist() == [0.0] and alone.errors == 1
    assert result.scores.tolist() == [1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.5]
    assert result.errors == 6 and result.row_errors[0] is None and result.row_errors[-1] is None
    assert "OverflowError" in result.row_errors[1] and "within ±1e+06" in result.row_errors[2]
    assert "evil float" in result.row_errors[3] and "without a 'score' key" in result.row_errors[4]
    assert "at most 32" in result.row_errors[5] and "Mute" in result.row_errors[6]
    assert result.metrics == {"reward/(1, 2)/mean": 3.0, "reward/errors": 6.0}


@pytest.mark.parametrize(
    ("suffix", "message"),
    [
        (
            "tandem_no_such_module:score",
            "reward function 'tandem_no_such_module:score' could not be imported: "
            "No module named 'tandem_no_such_module'",
        ),
        (
            "{mod}:missing",
            "reward function '{mod}:missing' not found: '{mod}' has no attribute 'missing'",
        ),
        (
            "{mod}:two_args",
            "reward function '{mod}:two_args' has signature (a, b); expected (prompt, response, ground_truth, extra)",
        ),
        ("{mod}:not_callable", "reward function '{mod}:not_callable' is not callable (type int)"),
        ("{mod}:Scorer", "reward function '{mod}:Scorer' is a class, not a function"),
        ("builtin:nope", "reward function 'builtin:nope' is not a built-in"),
        ("no_colon", "is malformed"),
        ("missing_dir/rewards.py:score", "could not be imported: no such file"),
    ],
)
def test_bad_references_give_specific_messages(user_module, suffix, message):
    ref, message = suffix.format(mod=user_module), message.format(mod=user_module)
    with pytest.raises(RewardFunctionError) as info:
        load_reward_fn(ref)
    assert message in str(info.value)


def test_module_that_fails_on_import(tmp_path):
    path = tmp_path / "broken.py"
    path.write_text("raise KeyError('setting')\n")
    with pytest.raises(RewardFunctionError, match=r"could not be imported: KeyError: 'setting'"):
        load_reward_fn(f"{path}:score")


# ---- parallel scoring -------------------------------------------------------------------------


def test_parallel_scoring_equals_serial_in_order(tmp_path):
    path = tmp_path / "rewards_for_pool.py"
    path.write_text(
        textwrap.dedent(
            """
            import os

            def score(prompt, response, ground_truth, extra):
                if response == "raise":
                    raise ValueError("no")
                return {"score": (int(response) * 7 + int(ground_truth)) % 11 / 10, "pid": os.getpid()}
            """
        )
    )
    n = 200
    responses = [str(i) if i % 37 else "raise" for i in range(n)]
    truths = [i % 5 for i in range(n)]
    args = (["p"] * n, responses, truths, [None] * n)
    serial = RewardScorer(f"{path}:score").score(*args)
    with RewardScorer(f"{path}:score", num_workers=2, parallel_threshold=10) as scorer:
        parallel = scorer.score(*args)
        again = scorer.score(*args)  # the pool is reused
    assert torch.equal(serial.scores, parallel.scores) and torch.equal(serial.scores, again.scores)
    assert parallel.errors == serial.errors == 6
    assert parallel.error_messages == serial.error_messages
    # The work really ran elsewhere: in sandboxes, each with a pid namespace of its own.
    assert os.getpid() not in (parallel.metrics["reward/pid/mean"], serial.metrics["reward/pid/mean"])


def test_a_builtin_with_workers_scores_large_batches_in_unsandboxed_processes():
    responses = [f" {i % 3} " for i in range(30)]
    args = (["p"] * 30, responses, ["1"] * 30, [None] * 30)
    serial = RewardScorer("builtin:exact_match").score(*args)
    with RewardScorer("builtin:exact_match", num_workers=2, parallel_threshold=10) as scorer:
        assert scorer.boxes[0].mode == "none"  # the service's code: a process, no sandbox
        parallel = scorer.score(*args)
        small = scorer.score(["p"], ["1"], ["1"])  # at most the threshold: scored here
    assert torch.equal(serial.scores, parallel.scores) and parallel.scores.sum() == 10
    assert small.scores.tolist() == [1.0] and parallel.errors == 0


def test_a_hanging_function_times_out_in_the_pool(tmp_path):
    path = tmp_path / "slow_rewards.py"
    path.write_text(
        "import time\n\ndef score(p, r, g, e):\n    time.sleep(600 if r == 'hang' else 0)\n    return 1.0\n"
    )
    responses = ["hang"] + ["ok"] * 39
    with RewardScorer(f"{path}:score", num_workers=2, parallel_threshold=10, timeout_s=10) as scorer:
        result = scorer.score(["p"] * 40, responses, [None] * 40)
        assert scorer.score(["p"], ["ok"], [None]).scores.tolist() == [1.0]  # a fresh sandbox took over
    assert result.scores[0] == 0.0 and result.scores[-1] == 1.0
    assert 1 <= result.errors < 40 and "did not finish within 10 s" in result.error_messages[0]


def test_score_rejects_mismatched_lengths():
    with pytest.raises(ValueError):
        RewardScorer("builtin:exact_match").score(["p", "q"], ["a"], ["a", "b"])


def test_decode_responses_keeps_only_the_sampled_tokens_of_each_row(tiny_model_dir):
    from transformers import AutoTokenizer

    from controller.step_math import decode_responses
    from workers.batch import Batch

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    rows = ["12+7", "abc", "x=4"]
    ids = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in rows]
    width = max(len(r) for r in ids) + 2
    responses = torch.full((3, width), tokenizer.pad_token_id)
    mask = torch.zeros((3, width), dtype=torch.long)
    for i, row in enumerate(ids):
        responses[i, : len(row)] = torch.tensor(row)
        mask[i, : len(row)] = 1
    responses[1, 1] = ids[0][0]  # a token the mask leaves out (an environment's, in a multi-turn row)
    mask[1, 1] = 0
    batch = Batch.from_dict({"responses": responses, "response_mask": mask})
    texts = decode_responses(batch, tokenizer)
    assert texts == [
        "12+7",
        tokenizer.decode([ids[1][0]] + ids[1][2:], skip_special_tokens=True),
        "x=4",
    ]
