"""HFRolloutEngine on the tiny-qwen2 model: padding invariance, stopping, sampling, log-probs that
match a plain forward pass, in-place weight updates and the release/resume cycle."""

from __future__ import annotations

import pytest
import torch

from engines.models.tiny_models import TinyModelSpec, build_tiny_model
from engines.rollout.base import RolloutEngineError, SamplingParams
from engines.rollout.hf import HFRolloutEngine
from engines.rollout.sampling import filter_logits

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [12, 13], [20, 21, 22, 23], [40]]
GREEDY = SamplingParams(max_new_tokens=12, temperature=0)


@pytest.fixture(scope="module")
def engine(tiny_model_dir) -> HFRolloutEngine:
    torch.set_num_threads(1)
    return HFRolloutEngine(tiny_model_dir, device="cpu", dtype="float32")


def forward_log_probs(
    engine: HFRolloutEngine, prompt: list[int], tokens: list[int], temperature: float = 1.0
):
    """log_softmax(logits / T) of the generated tokens, from one full forward pass of prompt + tokens."""
    with torch.no_grad():
        logits = engine.model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1].float()
    log_probs = (logits / temperature).log_softmax(-1)
    return log_probs.gather(-1, torch.tensor(tokens)[:, None]).squeeze(-1)


def test_greedy_batched_equals_one_by_one(engine):
    batched = engine.generate(PROMPTS, GREEDY)
    for prompt, completion in zip(PROMPTS, batched, strict=True):
        alone = engine.generate([prompt], GREEDY)[0]
        assert completion.token_ids == alone.token_ids
        assert completion.log_probs == pytest.approx(alone.log_probs, abs=1e-5)
        assert len(completion.token_ids) == GREEDY.max_new_tokens and completion.finish_reason == "length"


def test_stop_tokens_end_each_row_and_leave_the_others_alone(engine):
    free = engine.generate(PROMPTS, GREEDY)
    stop = free[0].token_ids[4]  # a token row 0 produces mid-way
    stopped = engine.generate(PROMPTS, GREEDY.model_copy(update={"stop_token_ids": [stop]}))
    for before, after in zip(free, stopped, strict=True):
        if stop in before.token_ids:
            cut = before.token_ids.index(stop) + 1  # the stop token is kept
            assert after.token_ids == before.token_ids[:cut] and after.finish_reason == "stop"
            assert len(after.log_probs) == cut
        else:  # rows that never meet it keep decoding next to finished ones, unchanged
            assert after.token_ids == before.token_ids and after.finish_reason == "length"


def test_eos_from_the_constructor_stops(tiny_model_dir, engine):
    first = engine.generate([PROMPTS[1]], GREEDY)[0].token_ids[0]
    other = HFRolloutEngine(tiny_model_dir, eos_token_ids=[first])
    completion = other.generate([PROMPTS[1]], GREEDY)[0]
    assert completion.token_ids == [first] and completion.finish_reason == "stop"


def test_max_new_tokens_and_prompt_major_order(engine):
    params = SamplingParams(max_new_tokens=3, n=3, seed=0)
    out = engine.generate(PROMPTS, params)
    assert [c.prompt_index for c in out] == [i for i in range(len(PROMPTS)) for _ in range(3)]
    for c in out:  # a sampled EOS may end a row early; otherwise it runs to the cap
        ended_by_eos = c.token_ids[-1] in engine.eos_token_ids
        assert c.finish_reason == ("stop" if ended_by_eos else "length")
        assert len(c.token_ids) == len(c.log_probs) and (len(c.token_ids) == 3 or ended_by_eos)


def test_seeded_sampling_is_reproducible_and_leaves_the_global_rng_alone(engine):
    params = SamplingParams(max_new_tokens=10, temperature=1.0, n=2, seed=123)
    rng_before = torch.get_rng_state()
    first = engine.generate(PROMPTS, params)
    assert torch.equal(torch.get_rng_state(), rng_before)
    again = engine.generate(PROMPTS, params)
    other = engine.generate(PROMPTS, params.model_copy(update={"seed": 124}))
    assert [c.token_ids for c in first] == [c.token_ids for c in again]
    assert [c.token_ids for c in first] != [c.token_ids for c in other]
    assert first[0].token_ids != first[1].token_ids  # the n samples of one prompt differ


def test_log_probs_at_temperature_one_equal_a_full_forward(engine):
    out = engine.generate(PROMPTS, SamplingParams(max_new_tokens=12, temperature=1.0, n=2, seed=7))
    for c in out:
        reference = forward_log_probs(engine, PROMPTS[c.prompt_index], c.token_ids)
        assert torch.allclose(torch.tensor(c.log_probs), reference, atol=1e-5, rtol=0)


def test_log_probs_at_temperature_half_are_of_the_scaled_distribution(engine):
    out = engine.generate(PROMPTS, SamplingParams(max_new_tokens=8, temperature=0.5, seed=1))
    for c in out:
        reference = forward_log_probs(engine, PROMPTS[c.prompt_index], c.token_ids, temperature=0.5)
        assert torch.allclose(torch.tensor(c.log_probs), reference, atol=1e-5, rtol=0)


def test_log_probs_under_top_k_are_renormalised_over_the_kept_set(engine):
    out = engine.generate(PROMPTS, SamplingParams(max_new_tokens=6, top_k=5, seed=2))
    for c in out:
        prompt = PROMPTS[c.prompt_index]
        with torch.no_grad():
            logits = engine.model(torch.tensor([prompt + c.token_ids])).logits[0, len(prompt) - 1 : -1]
        kept = filter_logits(logits.float(), top_k=5, top_p=1.0)
        assert (kept > float("-inf")).sum(-1).eq(5).all()
        reference = kept.log_softmax(-1).gather(-1, torch.tensor(c.token_ids)[:, None]).squeeze(-1)
        assert torch.allclose(torch.tensor(c.log_probs), reference, atol=1e-5, rtol=0)


def test_top_k_one_and_tiny_top_p_equal_greedy(engine):
    greedy = [c.token_ids for c in engine.generate(PROMPTS, GREEDY)]
    top_k = engine.generate(PROMPTS, GREEDY.model_copy(update={"temperature": 1.0, "top_k": 1, "seed": 5}))
    top_p = engine.generate(PROMPTS, GREEDY.model_copy(update={"temperature": 1.0, "top_p": 1e-6, "seed": 5}))
    assert [c.token_ids for c in top_k] == greedy
    assert [c.token_ids for c in top_p] == greedy
    assert all(lp == pytest.approx(0.0, abs=1e-6) for c in top_k for lp in c.log_probs)


def test_filter_logits_top_p_keeps_the_smallest_set_reaching_the_mass():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    kept = filter_logits(logits, top_k=-1, top_p=0.7) > float("-inf")
    assert kept.tolist() == [[True, True, False, False]]
    assert (filter_logits(logits, top_k=0, top_p=1.0) == logits).all()


def test_update_weights_loads_the_stream_and_bumps_the_version(tiny_model_dir):
    engine = HFRolloutEngine(tiny_model_dir)
    before = engine.generate(PROMPTS, GREEDY)
    generator = torch.Generator().manual_seed(0)
    new = {
        k: v + 0.5 * torch.randn(v.shape, generator=generator) for k, v in engine.model.state_dict().items()
    }
    items = list(new.items())
    engine.update_weights(items[: len(items) // 2])  # two buckets, one sync
    engine.update_weights(items[len(items) // 2 :])
    assert engine.finish_update() == 1 and engine.weight_version == 1
    state = engine.model.state_dict()
    assert all(torch.equal(state[k], v) for k, v in new.items())
    after = engine.generate(PROMPTS, GREEDY)
    assert [c.token_ids for c in after] != [c.token_ids for c in before]
    assert {c.weight_version for c in before} == {0} and {c.weight_version for c in after} == {1}


def test_update_weights_rejects_unknown_names_and_wrong_shapes(engine):
    with pytest.raises(KeyError, match="model.layers.99.mlp.up_proj.weight"):
        engine.update_weights([("model.layers.99.mlp.up_proj.weight", torch.zeros(2))])
    name, tensor = next(iter(engine.model.state_dict().items()))
    with pytest.raises(ValueError, match=r"shape \(3, 3\)"):
        engine.update_weights([(name, torch.zeros(3, 3))])


@pytest.mark.parametrize("stream_lm_head", [False, True])
def test_tied_embeddings_follow_the_embedding_stream(tmp_path, stream_lm_head):
    folder = build_tiny_model(tmp_path / "tied", TinyModelSpec(tie_word_embeddings=True))
    engine = HFRolloutEngine(folder)
    embedding = torch.randn_like(engine.model.get_input_embeddings().weight)
    stream = [("model.embed_tokens.weight", embedding)]
    if stream_lm_head:
        stream.append(("lm_head.weight", embedding))
    engine.update_weights(stream)
    assert torch.equal(engine.model.get_output_embeddings().weight, embedding)


def test_release_blocks_generate_until_resumed(tiny_model_dir):
    engine = HFRolloutEngine(tiny_model_dir)
    engine.release_memory()
    assert engine.is_released
    with pytest.raises(RolloutEngineError, match="resume_memory"):
        engine.generate(PROMPTS, GREEDY)
    engine.resume_memory()
    assert not engine.is_released
    assert len(engine.generate(PROMPTS, GREEDY)) == len(PROMPTS)


def test_empty_prompt_is_refused(engine):
    with pytest.raises(ValueError, match="empty prompt"):
        engine.generate([[1, 2], []], GREEDY)


def test_an_unset_free_cache_releases_only_when_the_engine_is_short_of_memory(tiny_model_dir):
    """rollout.free_cache_after_generate unset: the hf engine on a CPU keeps its weights between calls
    (a release would only cost a gc pass); set true, the role releases as before."""
    from schema.workers import RolloutOptions
    from workers.rollout_role import RolloutWorker

    engine = HFRolloutEngine(tiny_model_dir)
    assert RolloutOptions().free_cache_after_generate is None
    assert engine.memory_is_short() is False
    role = RolloutWorker.__new__(RolloutWorker)  # only settle_rollout_memory's two attributes
    role.rollout = engine
    role.rollout_config = RolloutOptions()
    role.settle_rollout_memory()
    assert not engine.is_released
    role.rollout_config = RolloutOptions(free_cache_after_generate=True)
    role.settle_rollout_memory()
    assert engine.is_released
