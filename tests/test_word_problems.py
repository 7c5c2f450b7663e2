"""The word-problem task and its answer extraction, checked on replies the real SmolLM2-135M-Instruct
model wrote (greedy, through its chat template), and the error a missing model package gives."""

from __future__ import annotations

import pytest

from controller.models import BUILTIN_MODEL_NAMES
from controller.rewards import load_reward_fn
from controller.tasks import get_task
from controller.tasks.word_problems import INSTRUCTION, extract_final_number, word_problem_reward
from engines.models.pretrained import PackagedModel, PackagedModelMissing, packaged_gguf

# Replies of SmolLM2-135M-Instruct (greedy, 48 new tokens) to prompts of this shape.
REAL_REPLIES = [
    ("Sam takes 8 pens out of the box, which means Sam has 23 - 8 = 11 pens left in the box.<|im_end|>", "15", "11"),
    ("To add 34 and 25, we need to follow the order of operations: parentheses, exponents, and carryover.\n\n"
     "First, we add the numbers: 34 + 25 = 59.", "59", "59"),
    ("The answer is 58.<|im_end|>", "58", "58"),
    ("Lily has 5 bags with 6 marbles each, which means she has 5 x 6 = 30 marbles in each bag.\nTo find out how "
     "many marbles she has, we need to divide the total number of marbles", "30", "30"),
    ("Tom has 12 apples - 7 apples = 2 apples left.\nHe buys 2 apples, so he has 12 - 2 = 10 apples remaining.\n"
     "Tom has 10 apples now.", "19", "10"),
]  # fmt: skip


@pytest.mark.parametrize(("reply", "truth", "extracted"), REAL_REPLIES)
def test_the_final_number_of_real_model_replies(reply, truth, extracted):
    assert extract_final_number(reply) == extracted
    assert word_problem_reward("", reply, truth)["score"] == float(extracted == truth)


@pytest.mark.parametrize(
    ("reply", "expected"),
    [
        ("so 3 + 4 = 7, and the result is \\boxed{7}. Check: 7 - 4 = 3", "7"),  # boxed beats a later number
        ("12 + 30 = 42. Answer: 42<|im_end|> 99", "42"),  # cut at the end marker
        ("The answer is 1,200 stamps, not 12", "1200"),  # "answer is" beats the last number
        ("She has 37.0 coins", "37"),
        ("I am not sure.", None),
        ("answer: -5", "-5"),
    ],
)
def test_extraction_rules(reply, expected):
    assert extract_final_number(reply) == expected


def test_format_score_rewards_the_requested_answer_line():
    assert word_problem_reward("", "23 + 14 = 37\nAnswer: 37", "37") == {"score": 1.0, "format": 1.0}
    assert word_problem_reward("", "23 + 14 = 37", "37") == {"score": 1.0, "format": 0.0}


@pytest.mark.parametrize(("name", "largest"), [("word-problems", 99), ("word-problems-easy", 9)])
def test_the_task_is_deterministic_disjoint_and_correct(name, largest):
    task = get_task(name)
    train, again = task.make_split("train", 300, seed=1), task.make_split("train", 300, seed=1)
    val = task.make_split("val", 50, seed=1)
    assert train == again and train != task.make_split("train", 300, seed=2)
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in val}
    assert len({r["prompt"] for r in train}) == 300
    for row in train + val:
        assert row["prompt"].endswith(INSTRUCTION)
        numbers = [int(w) for w in row["prompt"].replace("?", " ").replace(".", " ").split() if w.isdigit()]
        a, b = numbers
        assert max(a, b) <= largest
        assert int(row["ground_truth"]) in (a + b, abs(a - b), a * b)
        assert int(row["ground_truth"]) >= 0
    assert load_reward_fn("builtin:word_problems") is word_problem_reward


def test_a_missing_model_package_names_the_extra():
    assert "smollm2-135m-instruct" in BUILTIN_MODEL_NAMES
    absent = PackagedModel(
        package="no-such-pkg", module="no_such_pkg_xyz", gguf_file="m.gguf", description=""
    )
    with pytest.raises(PackagedModelMissing, match=r"'no-such-pkg'.*make install-real"):
        packaged_gguf(absent)
