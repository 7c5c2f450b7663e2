"""The hf engine's static decode (engines/rollout/graph_decode.py), the step a CUDA graph captures on a
GPU, run eagerly on the CPU: its logits against transformers' forward on ragged padded batches, and
whole generations against the step-by-step loop (`_decode`) for both architectures: greedy tokens equal,
log-probs within 1e-5, stops, shared prompts, rows padded to a power of two, decoders kept between calls
(at most `KEPT_DECODERS`) and built for new shapes,
weight syncs seen by a kept decoder, and grammar-constrained calls left to the loop."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoTokenizer

from engines.models.tiny_models import TinyModelSpec, build_tiny_model
from engines.rollout.base import SamplingParams
from engines.rollout.constrained import build_constraint
from engines.rollout.graph_decode import CAPACITY_STEP, StaticDecoder, capacity_for
from engines.rollout.hf import DecodeMask, HFRolloutEngine

RAGGED = [[5, 6, 7, 8, 9, 10, 11], [12, 13], [20, 21, 22, 23], [40], [12, 13]]
GREEDY = SamplingParams(max_new_tokens=20, temperature=0)


@pytest.fixture(scope="module", params=["qwen2", "llama"])
def model_dir(request, tmp_path_factory):
    # Three layers, grouped-query attention (4 heads over 2 kv heads); qwen2 has q/k/v biases.
    spec = TinyModelSpec(arch=request.param, num_layers=3, num_heads=4, num_kv_heads=2)
    return build_tiny_model(tmp_path_factory.mktemp(request.param), spec)


@pytest.fixture(scope="module")
def engines(model_dir) -> tuple[HFRolloutEngine, HFRolloutEngine]:
    torch.set_num_threads(1)
    static = HFRolloutEngine(model_dir, dtype="float32", graph_decode=True)
    loop = HFRolloutEngine(model_dir, dtype="float32", graph_decode=False)
    return static, loop


def last(engine: HFRolloutEngine) -> StaticDecoder:
    """The decoder the engine used last."""
    return next(reversed(engine._decoders.values()))


def assert_same(static, loop):
    assert [c.token_ids for c in static] == [c.token_ids for c in loop]
    assert [c.finish_reason for c in static] == [c.finish_reason for c in loop]
    for a, b in zip(static, loop, strict=True):
        assert a.log_probs == pytest.approx(b.log_probs, abs=1e-5)


def test_the_static_step_gives_transformers_logits_on_a_padded_batch(engines):
    engine, _ = engines
    steps = 6
    with torch.inference_mode():
        logits, cache, prompt_mask, positions = engine._prefill(RAGGED, steps)
        width = prompt_mask.shape[1]
        decoder = StaticDecoder(engine._weights, len(RAGGED), capacity_for(width + steps), capture=False)
        decoder.start(cache, prompt_mask)
        mask = DecodeMask(prompt_mask, steps, plain=False)
        position = positions[:, -1:] + 1
        for step in range(steps - 1):
            token = logits.argmax(-1)[:, None]
            ours = decoder.step(token, position, width + step)
            logits = engine._forward(token, mask.at(width + step + 1), position, cache)
            torch.testing.assert_close(ours, logits, rtol=1e-5, atol=1e-5)
            position = position + 1


def test_greedy_generations_equal_the_step_by_step_loop(engines):
    static, loop = engines
    assert static._graph_decode and not loop._graph_decode
    assert_same(static.generate(RAGGED, GREEDY), loop.generate(RAGGED, GREEDY))
    assert last(static).key()[0] == 8  # 5 rows, decoded as 8


def test_stops_end_rows_alone_and_the_batch_ends_when_all_stopped(engines):
    static, loop = engines
    first = loop.generate(RAGGED, GREEDY)
    stop = first[1].token_ids[2]  # row 1 stops on its third token; others may too, where they meet it
    params = SamplingParams(max_new_tokens=20, temperature=0, stop_token_ids=[stop])
    ours, theirs = static.generate(RAGGED, params), loop.generate(RAGGED, params)
    assert_same(ours, theirs)
    assert ours[1].finish_reason == "stop" and len(ours[1].token_ids) <= 3
    everyone = {c.token_ids[0] for c in first}
    params = SamplingParams(max_new_tokens=20, temperature=0, stop_token_ids=sorted(everyone))
    ours = static.generate(RAGGED, params)
    assert all(len(c.token_ids) == 1 and c.finish_reason == "stop" for c in ours)


def test_a_kept_decoder_serves_calls_of_near_shapes_and_a_new_shape_builds_another(engines):
    static, loop = engines
    static.generate(RAGGED, GREEDY)
    kept = last(static)
    again = [[30, 31], [32], [33, 34, 35], [36], [37, 38], [39], [40, 41]]  # 7 rows: also 8
    assert_same(static.generate(again, GREEDY), loop.generate(again, GREEDY))
    assert last(static) is kept
    longer = SamplingParams(max_new_tokens=CAPACITY_STEP + 4, temperature=0)
    assert_same(static.generate(RAGGED[:3], longer), loop.generate(RAGGED[:3], longer))
    assert last(static) is not kept and last(static).key() == (4, 2 * CAPACITY_STEP)
    assert static._decoders[kept.key()] is kept  # the earlier shape is still kept


def test_at_most_the_kept_number_of_decoders_stay_the_least_recent_going_first(engines):
    static, loop = engines
    static._decoders.clear()
    shapes = [1, 2, 3, 5, 9]  # 1, 2, 4, 8, 16 rows
    for n in shapes:
        prompts = [[7 + i, 8] for i in range(n)]
        assert_same(static.generate(prompts, GREEDY), loop.generate(prompts, GREEDY))
    assert [key[0] for key in static._decoders] == [2, 4, 8, 16]


def test_a_weight_sync_reaches_a_kept_decoder(engines):
    static, loop = engines
    static.generate(RAGGED, GREEDY)
    kept = last(static)
    name = "model.layers.0.mlp.down_proj.weight"
    weight = dict(loop.model.named_parameters())[name]
    changed = weight.detach() + 0.5 * torch.randn(weight.shape, generator=torch.Generator().manual_seed(0))
    before = static.generate(RAGGED, GREEDY)
    try:
        for engine in (static, loop):
            engine.update_weights([(name, changed)])
        after = static.generate(RAGGED, GREEDY)
        assert last(static) is kept
        assert_same(after, loop.generate(RAGGED, GREEDY))
        assert [c.token_ids for c in after] != [c.token_ids for c in before]
    finally:
        for engine in (static, loop):
            engine.update_weights([(name, weight.detach().clone())])


def test_shared_prompts_and_sampling_draw_valid_rows_of_the_right_length(engines):
    static, loop = engines
    group = [RAGGED[0]] * 4 + [RAGGED[3]] * 4
    assert_same(static.generate(group, GREEDY), loop.generate(group, GREEDY))
    params = SamplingParams(max_new_tokens=12, temperature=1.0, seed=3)
    sampled = static.generate(group, params)
    assert sampled == static.generate(group, params)  # seeded: reproducible
    assert len({tuple(c.token_ids) for c in sampled}) > 1
    for prompt, c in zip(group, sampled, strict=True):  # each token's log-prob is its model's
        assert len(c.log_probs) == len(c.token_ids) <= 12
        assert (c.finish_reason == "length") == (len(c.token_ids) == 12)
        with torch.no_grad():
            logits = loop.model(torch.tensor([prompt + c.token_ids])).logits[0, len(prompt) - 1 : -1]
        expected = logits.float().log_softmax(-1).gather(-1, torch.tensor(c.token_ids)[:, None])
        assert c.log_probs == pytest.approx(expected.squeeze(-1).tolist(), abs=1e-4)


def test_a_grammar_constrained_call_keeps_the_step_by_step_loop(engines, model_dir):
    static, loop = engines
    constraint = build_constraint({"type": "json_object"}, None, None)
    params = SamplingParams(max_new_tokens=16, n=4, seed=5, constraint=constraint)
    ours = static.generate(RAGGED[:2], params)
    assert ours == loop.generate(RAGGED[:2], params)  # the same loop, the same draws
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    assert all(tokenizer.decode(c.token_ids, skip_special_tokens=True).startswith("{") for c in ours)
