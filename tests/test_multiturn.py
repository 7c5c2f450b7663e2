"""Multi-turn rollouts without Ray: token-exact trajectories, loss masks, truncation, failing envs.

The rollout engine is the real embedded hf engine on the built-in chat model; environments are
the scripted ones of tests/multiturn_envs.py and the built-ins.
"""

from __future__ import annotations

import pytest
import torch

from engines.models.tiny_models import build_builtin_model
from engines.rollout import SamplingParams, build_rollout_engine
from engines.training.base import SCORED
from workers.chat_serving import ChatDelta
from workers.multiturn import EnvironmentConfig, MultiTurnRollout, trajectory_tensors

WIDTH = 48


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    return build_builtin_model("tiny-qwen2-chat", tmp_path_factory.mktemp("chat"))


@pytest.fixture(scope="module")
def delta(chat_model):
    from transformers import AutoTokenizer

    return ChatDelta(AutoTokenizer.from_pretrained(chat_model))


@pytest.fixture(scope="module")
def engine(chat_model):
    return build_rollout_engine("hf", chat_model)


def run(engine, delta, ref, rows, seed=1, **config):
    cfg = EnvironmentConfig(ref=ref, **config)
    params = SamplingParams(max_new_tokens=6, temperature=1.0, seed=seed)
    return MultiTurnRollout(engine, delta, cfg).run(rows, params, WIDTH)


def rebuilt_conversation(delta, traj, observations):
    """The conversation as messages: reset messages, decoded sampled runs, and the observations."""
    runs, current = [], []
    for token, sampled in zip(traj.tokens, traj.loss_mask, strict=True):
        if sampled:
            current.append(token)
        elif current:
            runs.append(current)
            current = []
    runs.append(current)
    messages = list(observations[0])
    for i, run_ids in enumerate(runs):
        messages.append(
            {"role": "assistant", "content": delta.assistant_text(run_ids, skip_special_tokens=False)}
        )
        if i + 1 < len(observations):
            messages += observations[i + 1]
    return messages, runs


def test_trajectory_tokens_equal_the_rendering_of_the_whole_conversation(engine, delta):
    rows = [{"prompt": f"q{i}", "ground_truth": None, "extra": {"turns": 4}} for i in range(3)]
    trajectories = run(engine, delta, "tests.multiturn_envs:ScriptedEnv", rows, max_response_tokens=200)
    for traj in trajectories:
        assert traj.finish_reason == "done" and traj.turns == 4 and traj.reward == 1.0
        assert traj.tool_calls == 2
        first = [{"role": "system", "content": "be brief"}, {"role": traj.messages[1]["role"],
                 "content": traj.messages[1]["content"]}]  # fmt: skip
        observations = [first, [{"role": "tool", "content": "t1"}], [{"role": "user", "content": "again 2"}],
                        [{"role": "tool", "content": "t3"}]]  # fmt: skip
        messages, runs = rebuilt_conversation(delta, traj, observations)
        assert len(runs) == 4
        rendered = delta.encode(delta.tokenizer.apply_chat_template(messages, tokenize=False))
        ours = traj.prompt_ids + traj.tokens
        ended = runs[-1] and runs[-1][-1] == delta.turn_end_id
        closing = delta.encode(delta.assistant_suffix)[1 if ended else 0 :]  # tokens, not characters
        assert ours + closing == rendered
        # Sampled tokens carry their log-probs; template and observation tokens carry 0 and mask 0.
        sampled = torch.tensor(traj.loss_mask, dtype=torch.bool)
        assert int(sampled.sum()) == sum(len(r) for r in runs)
        assert all(lp < 0 for lp, m in zip(traj.log_probs, traj.loss_mask, strict=True) if m)
        assert all(lp == 0 for lp, m in zip(traj.log_probs, traj.loss_mask, strict=True) if not m)


def test_layout_trains_only_sampled_tokens(engine, delta):
    rows = [{"prompt": "abc", "ground_truth": None, "extra": {"turns": 3}}, {"prompt": "d", "ground_truth": None,
            "extra": {"turns": 2}}]  # fmt: skip
    trajectories = run(engine, delta, "tests.multiturn_envs:ScriptedEnv", rows, max_response_tokens=120)
    td = trajectory_tensors(trajectories, WIDTH, 120, pad=0)
    for i, traj in enumerate(trajectories):
        p, n = len(traj.prompt_ids), len(traj.tokens)
        assert td["input_ids"][i, WIDTH - p : WIDTH + n].tolist() == traj.prompt_ids + traj.tokens
        assert int(td["attention_mask"][i].sum()) == p + n
        assert td["response_mask"][i, :n].tolist() == traj.loss_mask
        assert int(td["response_mask"][i, n:].sum()) == 0
        assert 0 < int(td["response_mask"][i].sum()) < n  # observations are in the sequence, not trained
    assert td["env_rewards"].tolist() == [1.0, 1.0]
    assert td["num_turns"].tolist() == [3, 2]


def test_truncation_by_turns_and_by_budget_is_marked(engine, delta):
    rows = [{"prompt": "x", "ground_truth": None, "extra": None}] * 2
    by_turns = run(
        engine, delta, "tests.multiturn_envs:NeverDoneEnv", rows, max_turns=3, max_response_tokens=400
    )
    assert [t.finish_reason for t in by_turns] == ["max_turns"] * 2
    assert [t.turns for t in by_turns] == [3, 3] and [t.reward for t in by_turns] == [0.75, 0.75]
    by_budget = run(
        engine, delta, "tests.multiturn_envs:NeverDoneEnv", rows, max_turns=50, max_response_tokens=20
    )
    assert [t.finish_reason for t in by_budget] == ["budget"] * 2
    assert all(len(t.tokens) <= 20 for t in by_budget)
    td = trajectory_tensors(by_turns + by_budget[:1], WIDTH, 400, pad=0)
    assert td["truncated"].tolist() == [1, 1, 1]


def test_a_failing_hanging_or_nan_rewarding_step_ends_only_its_trajectory(engine, delta):
    prompts = ("ok", "raise", "hang", "ok", "nan")
    rows = [{"prompt": p, "ground_truth": None, "extra": None} for p in prompts]
    trajectories = run(engine, delta, "tests.multiturn_envs:FaultyEnv", rows, step_timeout_s=1.0)
    assert [t.finish_reason for t in trajectories] == [
        "done",
        "env_error",
        "env_timeout",
        "done",
        "env_error",
    ]
    assert [t.reward for t in trajectories] == [1.0, 0.0, 0.0, 1.0, 0.0]  # a NaN reward never trains
    scored = trajectory_tensors(trajectories, WIDTH, 64, pad=0)[SCORED]
    assert scored.tolist() == [True, False, False, True, False]  # the environment's failures
    assert "tool crashed" in trajectories[1].error
    assert "not a number within ±1e+06: nan" in trajectories[4].error


def test_answers_outside_the_interface_end_only_their_trajectory(engine, delta):
    prompts = ("ok", "past_float32", "bad_role", "reset_empty", "reset_bad_role", "huge")
    rows = [{"prompt": p, "ground_truth": None, "extra": None} for p in prompts]
    trajectories = run(engine, delta, "tests.multiturn_envs:HostileEnv", rows, max_response_tokens=200)
    reasons = ["done", "env_error", "env_error", "env_error", "env_error", "budget"]
    assert [t.finish_reason for t in trajectories] == reasons
    td = trajectory_tensors(trajectories, WIDTH, 200, pad=0)
    assert td["env_rewards"].tolist() == [1.0, 0.0, 0.0, 0.0, 0.0, 0.0]  # 1e39 is inf in float32
    assert "within ±1e+06: 1e+39" in trajectories[1].error
    assert "role 'narrator'" in trajectories[2].error and "role 'narrator'" in trajectories[4].error
    assert "no messages" in trajectories[3].error
    assert len(trajectories[5].messages) == 2  # the huge observation is not kept


def test_an_environment_whose_reset_failed_is_released_from_its_sandbox(engine, delta):
    from workers.environments.sandboxed import _hosts

    ref = "tests.multiturn_envs:HostileEnv"
    rows = [{"prompt": p, "ground_truth": None, "extra": None} for p in ("reset_raise", "reset_empty", "ok")]
    trajectories = run(engine, delta, ref, rows)
    assert [t.finish_reason for t in trajectories] == ["env_error", "env_error", "done"]
    assert "no such task" in trajectories[0].error
    count = "from workers.environments import sandboxed\nresult = len(sandboxed._instances)"
    assert _hosts[ref].call("tests.sandbox_probes:run", [count], 30) == 0  # none left behind


def test_an_observation_the_chat_template_refuses_ends_only_its_trajectory(chat_model, engine):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(chat_model)
    # as templates that know no tool turns do (Mistral's, Gemma's): raise_exception
    tokenizer.chat_template = tokenizer.chat_template.replace(
        "{% for message in messages %}",
        "{% for message in messages %}{% if message['role'] == 'tool' %}"
        "{{ raise_exception('tool turns are not supported') }}{% endif %}",
    )
    rows = [{"prompt": "q", "ground_truth": None, "extra": {"turns": 3}}, {"prompt": "r", "ground_truth": None,
            "extra": {"turns": 1}}]  # fmt: skip
    trajectories = run(engine, ChatDelta(tokenizer), "tests.multiturn_envs:ScriptedEnv", rows)
    assert [t.finish_reason for t in trajectories] == ["env_error", "done"]
    assert "could not render the observation: tool turns are not supported" in trajectories[0].error


def test_calculator_env_answers_tool_calls_and_scores_the_final_answer(engine, delta):
    from workers.environments import CalculatorEnv

    env = CalculatorEnv()
    assert env.reset({"prompt": "347*218=", "ground_truth": "75646", "extra": None}) == "347*218="
    obs, reward, done, info = env.step("<calc>347*218</calc>")
    assert obs == {"role": "tool", "content": "75646"} and not done and info["tool_call"]
    assert env.step("75646") == (None, 1.0, True, {})
    assert env.step("75645")[1] == 0.0
    rendered = delta.observation_ids([obs], delta.turn_end_id)
    assert delta.tokenizer.decode(rendered) == "\n<|im_start|>tool\n75646<|im_end|>\n<|im_start|>assistant\n"


def test_a_first_observation_longer_than_the_prompt_width_ends_only_its_trajectory(engine, delta):
    prompts = ("ok", "word " * 100, "z" * 5000, "ok")  # past WIDTH tokens; past it in characters too
    rows = [{"prompt": p, "ground_truth": None, "extra": None} for p in prompts]
    trajectories = run(engine, delta, "tests.multiturn_envs:HostileEnv", rows)
    assert [t.finish_reason for t in trajectories] == ["done", "env_error", "env_error", "done"]
    assert "tokens, longer than data.max_prompt_length=48" in trajectories[1].error
    assert "5000 characters) is longer than data.max_prompt_length=48" in trajectories[2].error
    assert all(len(t.prompt_ids) <= WIDTH for t in trajectories)
    assert trajectory_tensors(trajectories, WIDTH, 64, pad=0)["env_rewards"].tolist() == [1.0, 0.0, 0.0, 1.0]
