"""data.reasoning_gym: rows from reasoning-gym's tasks, scored by the task's own scorer.

Hostile specs are refused at submission by a live service, naming the field; rows are
deterministic, mixed by weight and carry what scoring needs; answers are read out of completions as
docs/guides/reasoning-gym.md says; scoring runs in the reward sandbox, where a scorer that evals a
completion cannot touch the service's machine; and examples/reasoning_gym.yaml, submitted to the
live service, trains the tiny model (its reward rises).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from api.cli_spec import build_spec
from controller.data_files import DataError
from controller.reasoning_gym_task import (
    decode_entry,
    encode_entry,
    extract_answer,
    make_rows,
    reasoning_gym_reward,
    write_reasoning_gym_files,
)
from controller.rewards import RewardScorer
from schema.job import JobSpec
from schema.reasoning_gym import MAX_ROWS, ReasoningGymSpec
from tests.api_util import TERMINAL, tiny_job, wait_for

reasoning_gym = pytest.importorskip("reasoning_gym", reason="the reasoning-gym extra (make install)")

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "reasoning_gym.yaml"
GCD = {"name": "gcd", "config": {"max_value": 12}}


def rg_job(**section) -> dict:
    return tiny_job(data={"reasoning_gym": section}, reward={"function": "builtin:reasoning_gym"})


# ---- the spec, at submission ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("section", "param", "says"),
    [
        ({"tasks": ["gcd", "no_such_task"]}, "data.reasoning_gym.tasks.1.name", "choose one of"),
        ({"tasks": [{"name": "gcd", "config": {"bogus": 1}}]}, "data.reasoning_gym.tasks.0.config",
         "has no config key 'bogus'; its keys are ['max_numbers', 'max_value', 'min_numbers', 'min_value']"),
        ({"tasks": [{"name": "gcd", "config": {"max_value": 0}}]}, "data.reasoning_gym.tasks.0.config",
         "max_value must be > min_value"),
        ({"tasks": [{"name": "gcd", "config": {"max_value": "ten"}}]}, "data.reasoning_gym.tasks.0.config",
         "refuses this config: TypeError"),
        ({"tasks": [{"name": "gcd", "config": {"seed": 1}}]}, "data.reasoning_gym.tasks.0.config", "set by Tandem"),
        ({"tasks": [{"name": "gcd", "weight": 0}]}, "data.reasoning_gym.tasks.0.weight", "greater than 0"),
        ({"tasks": [{"name": "gcd", "weight": -1}]}, "data.reasoning_gym.tasks.0.weight", "greater than 0"),
        ({"tasks": [{"name": "gcd", "weight": "heavy"}]}, "data.reasoning_gym.tasks.0.weight", "number"),
        ({"tasks": [{"name": "gcd", "weight": True}]}, "data.reasoning_gym.tasks.0.weight", "number"),
        ({"tasks": ["gcd"], "size": 10**12}, "data.reasoning_gym.size", f"less than or equal to {MAX_ROWS}"),
        ({"tasks": ["gcd"], "val_size": -1}, "data.reasoning_gym.val_size", "greater than or equal to 0"),
        ({"tasks": []}, "data.reasoning_gym.tasks", "at least 1 item"),
        ({"tasks": "gcd"}, "data.reasoning_gym.tasks", "list"),
        ({"tasks": ["gcd"], "answer_format": "regex"}, "data.reasoning_gym.answer_format", "answer_tag"),
        ({"tasks": ["gcd"], "instructions": "be smart"}, "data.reasoning_gym.instructions", "direct"),
    ],
)  # fmt: skip
def test_hostile_sections_are_422_at_submission_naming_the_field(api, section, param, says):
    response = api.post("/v1/jobs", json=rg_job(**section))
    assert response.status_code == 422, response.text
    error = response.json()["error"]
    assert error["param"] == param and says in error["message"], error


def test_a_huge_weight_or_a_nan_one_is_refused_and_a_config_that_is_not_json_too():
    for weight in (float("nan"), float("inf"), 1e9):
        with pytest.raises(ValidationError, match=r"tasks\.0\.weight"):
            ReasoningGymSpec.model_validate({"tasks": [{"name": "gcd", "weight": weight}]})
    with pytest.raises(ValidationError, match="must be plain JSON data"):
        ReasoningGymSpec.model_validate({"tasks": [{"name": "gcd", "config": {"max_value": object()}}]})


def test_the_section_excludes_data_files_and_other_tasks_rewards(api):
    both = tiny_job(data={"train_path": "/x.jsonl", "reasoning_gym": {"tasks": ["gcd"]}},
                    reward={"function": "builtin:reasoning_gym"})  # fmt: skip
    response = api.post("/v1/jobs", json=both)
    assert response.status_code == 422 and response.json()["error"]["param"] == "data.train_path"
    default_reward = tiny_job(
        data={"reasoning_gym": {"tasks": ["gcd"]}}, reward={"function": "builtin:arithmetic"}
    )
    response = api.post("/v1/jobs", json=default_reward)
    assert response.status_code == 422, response.text
    assert response.json()["error"]["param"] == "reward.function"
    assert "builtin:reasoning_gym" in response.json()["error"]["message"]


def test_names_are_tasks_of_weight_one():
    spec = ReasoningGymSpec.model_validate({"tasks": ["gcd", GCD]})
    assert [(t.name, t.weight, t.config) for t in spec.tasks] == [
        ("gcd", 1.0, {}),
        ("gcd", 1.0, {"max_value": 12}),
    ]


# ---- rows ---------------------------------------------------------------------------------------


def test_rows_are_deterministic_mixed_by_weight_and_carry_their_task_and_entry():
    spec = ReasoningGymSpec.model_validate(
        {"tasks": [{"name": "gcd", "weight": 3}, {"name": "basic_arithmetic", "weight": 1}], "seed": 7}
    )
    rows = make_rows(spec, "train", 400)
    assert rows == make_rows(spec, "train", 400)
    assert rows != make_rows(spec.model_copy(update={"seed": 8}), "train", 400)
    tasks = [row["extra"]["reasoning_gym"]["task"] for row in rows]
    assert 0.68 < tasks.count("gcd") / len(tasks) < 0.82, tasks.count("gcd")  # 3:1 -> 0.75
    instructions = reasoning_gym.utils.SYSTEM_PROMPTS["default"].strip()
    for row in rows:
        carried = row["extra"]["reasoning_gym"]
        entry = decode_entry(carried["entry"])
        assert row["prompt"] == instructions + "\n\n" + entry["question"]
        assert (
            row["ground_truth"] == str(entry["answer"])
            and row["response"] == f"<answer>{entry['answer']}</answer>"
        )
        assert carried["answer_format"] == "answer_tag" and carried["config"] == {}
        json.dumps(row)  # a JSONL line as it stands


def test_validation_rows_leave_out_training_questions(tmp_path):
    # gcd of 1-12 has 144 questions: 100 training rows repeat many of them, so the validation split
    # draws more until it holds its 50 rows, none of a training question
    spec = ReasoningGymSpec.model_validate(
        {"tasks": [GCD], "size": 100, "val_size": 50, "instructions": None}
    )
    train, val = write_reasoning_gym_files(spec, tmp_path)
    questions = {json.loads(line)["prompt"] for line in train.read_text().splitlines()}
    assert len(train.read_text().splitlines()) == 100
    held_out = [json.loads(line)["prompt"] for line in val.read_text().splitlines()]
    assert len(held_out) == 50 and not questions & set(held_out)


def test_a_validation_split_the_training_rows_exhaust_is_refused_naming_size(tmp_path):
    # gcd of 1-3 has a handful of questions, every one among 50 training rows: a job that asked for
    # validation would otherwise train with none, silently
    spec = ReasoningGymSpec.model_validate(
        {"tasks": [{"name": "gcd", "config": {"max_value": 3}}], "size": 50, "val_size": 50}
    )
    with pytest.raises(DataError, match=r"^data\.reasoning_gym\.size: every validation question"):
        write_reasoning_gym_files(spec, tmp_path)
    assert not (tmp_path / "train.jsonl").exists() or not (tmp_path / "spec.json").exists()


def test_generation_past_its_time_limit_fails_the_job_naming_it(tmp_path):
    spec = ReasoningGymSpec.model_validate({"tasks": ["knight_swap"], "size": 5000, "timeout_s": 0.5})
    with pytest.raises(DataError, match=r"did not finish within 0.5 s; lower data.reasoning_gym.size"):
        write_reasoning_gym_files(spec, tmp_path)
    assert not (tmp_path / "spec.json").exists()  # nothing kept for a restart to trust


# ---- answers and scores -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("completion", "answer_format", "answer"),
    [
        ("I think <answer> 4 </answer>", "answer_tag", "4"),
        ("<answer>3</answer> no, <answer>4</answer>", "answer_tag", "4"),  # the last pair
        ("<answer>4</answer> then <answer>5", "answer_tag", "4"),  # an unclosed tag is no answer
        ("<answer>\n1 2\n3 4\n</answer>", "answer_tag", "1 2\n3 4"),  # grids span lines
        ("the answer is 4", "answer_tag", None),
        ("", "answer_tag", None),
        ("so 12 / 3\n 4 \n\n", "last_line", "4"),
        ("4", "last_line", "4"),
        ("  \n", "last_line", None),
    ],
)
def test_the_answer_read_out_of_a_completion(completion, answer_format, answer):
    assert extract_answer(completion, answer_format) == answer


def test_scores_are_the_tasks_own():
    spec = ReasoningGymSpec.model_validate({"tasks": ["gcd", "basic_arithmetic", "arc_agi"], "size": 6})
    for row in make_rows(spec, "train", 6):
        extra, answer = row["extra"], row["ground_truth"]
        assert reasoning_gym_reward("", f"... <answer>{answer}</answer>", None, extra) == {
            "score": 1.0,
            "format": 1.0,
        }
        assert reasoning_gym_reward("", f"... {answer}", None, extra) == {"score": 0.0, "format": 0.0}
        task = reasoning_gym.create_dataset(extra["reasoning_gym"]["task"], size=1, seed=0)
        entry = decode_entry(extra["reasoning_gym"]["entry"])
        wrong = f"{answer} or so"
        assert reasoning_gym_reward("", f"<answer>{wrong}</answer>", None, extra)[
            "score"
        ] == task.score_answer(wrong, entry)
    with pytest.raises(ValueError, match="rows that data.reasoning_gym generated"):
        reasoning_gym_reward("", "<answer>1</answer>", "1", {"other": 1})


def test_entries_keep_tuples_sets_and_keys_through_json():
    value = {"grid": ((1, 2), (3, 4)), "seen": {3, 1}, "by_id": {1: "a", 2: ("b",)}, "plain": [1, "x", None]}
    assert decode_entry(json.loads(json.dumps(encode_entry(value)))) == value
    with pytest.raises(ValueError, match="cannot be a set member"):
        decode_entry({"__set__": [[1]]})


def test_the_scorer_runs_in_the_sandbox_where_an_evaluated_completion_cannot_write_here(tmp_path):
    """n_queens' scorer evals the answer: a completion that is Python runs, but in the sandbox."""
    marker = tmp_path / "written-by-a-completion"
    spec = ReasoningGymSpec.model_validate({"tasks": ["n_queens"], "size": 1})
    (row,) = make_rows(spec, "train", 1)
    payload = f"<answer>open({str(marker)!r}, 'w').write('x') and [[]]</answer>"
    with RewardScorer("builtin:reasoning_gym") as scorer:
        assert len(scorer.boxes) == 1 and scorer.fn is None
        result = scorer.score(
            ["", ""], [payload, f"<answer>{row['ground_truth']}</answer>"], None, [row["extra"]] * 2
        )
    assert not marker.exists()
    assert result.scores.tolist() == [0.0, 1.0]


# ---- a job ------------------------------------------------------------------------------------------


def test_the_example_trains_the_tiny_model_through_the_service(api, tmp_path):
    """examples/reasoning_gym.yaml as `tandem submit` sends it: measured 0.004 (step 1) -> 0.227 (step
    30), first third 0.03, last third 0.21, in 52 s on two loaded cores."""
    _, spec = build_spec(str(EXAMPLE))
    job = api.post("/v1/jobs", json=spec.model_dump(mode="json")).json()
    assert wait_for(api, job["id"], TERMINAL, timeout_s=600)["status"] == "succeeded"
    rows = api.get(f"/v1/jobs/{job['id']}/metrics", params={"keys": "critic/score/mean,reward/errors"}).json()
    steps = [row["values"] for row in rows["data"] if "critic/score/mean" in row["values"]]  # not step 0's
    scores = [values["critic/score/mean"] for values in steps]
    assert len(scores) == spec.trainer.total_steps
    assert all(values["reward/errors"] == 0 for values in steps)
    third = len(scores) // 3
    assert sum(scores[-third:]) / third > sum(scores[:third]) / third + 0.08, scores


def test_the_example_is_a_valid_spec_whose_rows_fit_its_prompt_length():
    _, spec = build_spec(str(EXAMPLE))
    assert isinstance(spec, JobSpec) and spec.data.reasoning_gym is not None
    rows = make_rows(spec.data.reasoning_gym, "train", 50)
    assert max(len(row["prompt"]) for row in rows) <= spec.data.max_prompt_length  # one token a character


# ---- the guide ----------------------------------------------------------------------------------

GUIDE = EXAMPLE.parents[1] / "docs" / "guides" / "reasoning-gym.md"


def guide_specs() -> list[dict]:
    blocks = re.findall(r"```yaml\n(.*?)```", GUIDE.read_text(), re.S)
    return [yaml.safe_load(block) for block in blocks]


def test_the_guides_example_is_the_example_file_and_its_other_sections_validate():
    shown, *others = guide_specs()
    example = yaml.safe_load(EXAMPLE.read_text())
    assert {key: example[key] for key in shown} == shown
    for other in others:
        JobSpec.model_validate(other)  # the mix, as a reader would paste it
