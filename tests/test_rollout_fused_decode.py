"""The hf engine's fused decode step (engines/rollout/fused_decode.py) against transformers' own
forward: the same logits on ragged, padded batches for both architectures, weight syncs that reach
the fused buffers, and the models it leaves to transformers."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import save_file

from engines.models.tiny_models import TinyModelSpec, build_tiny_model
from engines.rollout.base import SamplingParams
from engines.rollout.hf import DecodeMask, HFRolloutEngine

RAGGED = [[5, 6, 7, 8, 9, 10, 11], [12, 13], [20, 21, 22, 23], [40], [12, 13]]
STEPS = 6


@pytest.fixture(scope="module", params=["qwen2", "llama"])
def model_dir(request, tmp_path_factory):
    # Three layers, grouped-query attention (4 heads over 2 kv heads); qwen2 has q/k/v biases.
    spec = TinyModelSpec(arch=request.param, num_layers=3, num_heads=4, num_kv_heads=2)
    return build_tiny_model(tmp_path_factory.mktemp(request.param), spec)


def decode_logits(engine: HFRolloutEngine, prompts: list[list[int]], fused: bool) -> torch.Tensor:
    """[STEPS, B, V] logits of a greedy decode, each step run by the fused step or by transformers."""
    with torch.inference_mode():
        logits, cache, prompt_mask, positions = engine._prefill(prompts, STEPS)
        width = prompt_mask.shape[1]
        mask = DecodeMask(prompt_mask, STEPS, plain=False)
        position = positions[:, -1:] + 1
        out = [logits]
        for step in range(STEPS - 1):
            token = logits.argmax(-1)[:, None]
            at = mask.at(width + step + 1)
            if fused:
                logits = engine._fused.step(token, position, cache, at)
            else:
                logits = engine._forward(token, at, position, cache)
            out.append(logits)
            position = position + 1
        return torch.stack(out)


def test_fused_step_gives_transformers_logits_on_a_padded_batch(model_dir):
    engine = HFRolloutEngine(model_dir, dtype="float32")
    assert engine._fused is not None
    fused, reference = decode_logits(engine, RAGGED, True), decode_logits(engine, RAGGED, False)
    assert fused.shape == reference.shape == (STEPS, len(RAGGED), engine.model.config.vocab_size)
    torch.testing.assert_close(fused, reference, rtol=1e-5, atol=1e-5)
    assert torch.equal(fused.argmax(-1), reference.argmax(-1))


def test_fused_step_without_padding(model_dir):
    engine = HFRolloutEngine(model_dir, dtype="float32")
    even = [[5, 6, 7], [8, 9, 10], [30, 31, 32]]  # no row padded: the step gets no mask
    torch.testing.assert_close(
        decode_logits(engine, even, True), decode_logits(engine, even, False), rtol=1e-5, atol=1e-5
    )


def test_projections_are_views_of_the_fused_buffers(model_dir):
    engine = HFRolloutEngine(model_dir, dtype="float32")
    layer = engine.model.model.layers[0]
    qkv = engine._fused.layers[0][1]
    attn = layer.self_attn
    assert attn.q_proj.weight.data_ptr() == qkv.data_ptr()
    assert attn.k_proj.weight.data_ptr() == qkv[attn.q_proj.weight.shape[0] :].data_ptr()
    assert torch.equal(torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]), qkv)


def test_a_weight_sync_reaches_the_fused_step(model_dir, tmp_path):
    """Greedy output after syncing new weights equals a fresh engine loaded from those weights."""
    engine = HFRolloutEngine(model_dir, dtype="float32")
    before = engine.generate(RAGGED, SamplingParams(max_new_tokens=8, temperature=0))
    generator = torch.Generator().manual_seed(1)
    new = {
        k: v + 0.3 * torch.randn(v.shape, generator=generator) for k, v in engine.model.state_dict().items()
    }
    engine.update_weights(new.items())
    engine.finish_update()
    synced = engine.generate(RAGGED, SamplingParams(max_new_tokens=8, temperature=0))

    folder = tmp_path / "perturbed"
    shutil.copytree(model_dir, folder)
    save_file({k: v.contiguous() for k, v in new.items()}, str(folder / "model.safetensors"))
    fresh = HFRolloutEngine(folder, dtype="float32").generate(
        RAGGED, SamplingParams(max_new_tokens=8, temperature=0)
    )
    assert [c.token_ids for c in synced] == [c.token_ids for c in fresh]
    assert [c.token_ids for c in synced] != [c.token_ids for c in before]
    for a, b in zip(synced, fresh, strict=True):
        assert a.log_probs == pytest.approx(b.log_probs, abs=1e-5)


def test_other_models_keep_transformers_forward(tiny_model_dir, tmp_path):
    assert HFRolloutEngine(tiny_model_dir, dtype="bfloat16")._fused is None  # float32 only
    sliding = tmp_path / "sliding"
    shutil.copytree(tiny_model_dir, sliding)
    config = json.loads((sliding / "config.json").read_text())
    config.update(use_sliding_window=True, sliding_window=4, max_window_layers=0)
    config["layer_types"] = ["sliding_attention"] * config["num_hidden_layers"]
    (sliding / "config.json").write_text(json.dumps(config))
    assert HFRolloutEngine(sliding, dtype="float32")._fused is None
