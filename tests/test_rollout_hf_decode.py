"""The hf engine's decode loop against transformers' own `generate`: the preallocated KV cache, the
prompt run once per group, the 4D padding masks, dropping finished rows, and the fallback to
transformers' masks for sliding-window models."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from transformers.cache_utils import DynamicLayer

from engines.rollout.base import SamplingParams
from engines.rollout.fused_decode import PreallocatedLayer
from engines.rollout.hf import DROP_FINISHED_AT, HFRolloutEngine, left_pad

RAGGED = [[5, 6, 7, 8, 9, 10, 11], [12, 13], [20, 21, 22, 23], [40], [12, 13], [5, 6, 7, 8, 9, 10, 11]]
EVEN = [[5, 6, 7], [8, 9, 10], [5, 6, 7], [30, 31, 32]]
GREEDY = SamplingParams(max_new_tokens=10, temperature=0)


@pytest.fixture(scope="module")
def engine(tiny_model_dir) -> HFRolloutEngine:
    torch.set_num_threads(1)
    return HFRolloutEngine(tiny_model_dir, device="cpu", dtype="float32")


def reference_greedy(engine: HFRolloutEngine, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """transformers' model.generate on the same left-padded batch, each row cut after its first EOS."""
    input_ids, mask = left_pad(prompts, engine.pad_token_id, engine.device)
    with torch.inference_mode():
        out = engine.model.generate(
            input_ids=input_ids,
            attention_mask=mask,
            max_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=engine.pad_token_id,
            eos_token_id=engine.eos_token_ids,
        )[:, input_ids.shape[1] :]
    rows = []
    for row in out.tolist():
        cut = next((i + 1 for i, t in enumerate(row) if t in engine.eos_token_ids), len(row))
        rows.append(row[:cut])
    return rows


@pytest.mark.parametrize("prompts", [RAGGED, EVEN], ids=["padded", "unpadded"])
def test_greedy_tokens_equal_transformers_generate(engine, prompts):
    ours = engine.generate(prompts, GREEDY)
    assert [c.token_ids for c in ours] == reference_greedy(engine, prompts, GREEDY.max_new_tokens)


def test_a_repeated_prompt_gives_each_sample_the_numbers_of_a_lone_prompt(engine):
    """The prompt of a group runs once; its n rows then decode as if each had run it alone."""
    params = SamplingParams(max_new_tokens=8, temperature=0, n=3)
    grouped = engine.generate(RAGGED[:3], params)
    for c in grouped:
        alone = engine.generate([RAGGED[c.prompt_index]], GREEDY.model_copy(update={"max_new_tokens": 8}))[0]
        assert c.token_ids == alone.token_ids
        assert c.log_probs == pytest.approx(alone.log_probs, abs=1e-5)


def test_dropping_finished_rows_leaves_the_others_unchanged(engine):
    prompts = [[4 + i, 9 + 2 * i, 50 - i] for i in range(12)]
    free = engine.generate(prompts, GREEDY)
    stops = {c.token_ids[1] for c in free[:4]}  # at least a third of the rows stop at their second token
    stopped = engine.generate(prompts, GREEDY.model_copy(update={"stop_token_ids": sorted(stops)}))
    cuts = [next((i + 1 for i, t in enumerate(c.token_ids) if t in stops), None) for c in free]
    assert sum(1 for cut in cuts if cut is not None and cut <= 2) * DROP_FINISHED_AT >= len(prompts)
    assert any(cut is None for cut in cuts), "some rows must decode on after the others are dropped"
    for before, after, cut in zip(free, stopped, cuts, strict=True):
        if cut is not None:
            assert after.token_ids == before.token_ids[:cut] and after.finish_reason == "stop"
        else:
            assert after.token_ids == before.token_ids and after.finish_reason == before.finish_reason
            assert after.log_probs == pytest.approx(before.log_probs, abs=1e-5)


def test_sliding_window_models_keep_transformers_masks(tiny_model_dir, tmp_path):
    folder = tmp_path / "sliding"
    shutil.copytree(tiny_model_dir, folder)
    config = json.loads((folder / "config.json").read_text())
    layers = config["num_hidden_layers"]
    config.update(
        use_sliding_window=True,
        sliding_window=3,
        max_window_layers=1,
        layer_types=["full_attention"] + ["sliding_attention"] * (layers - 1),
    )
    (folder / "config.json").write_text(json.dumps(config))
    engine = HFRolloutEngine(folder, dtype="float32")
    assert engine._plain_mask
    ours = engine.generate(RAGGED, GREEDY)
    assert [c.token_ids for c in ours] == reference_greedy(engine, RAGGED, GREEDY.max_new_tokens)


def test_preallocated_layer_holds_what_the_dynamic_layer_holds():
    generator = torch.Generator().manual_seed(0)
    ours, theirs = PreallocatedLayer(capacity=9), DynamicLayer()
    for length in (4, 1, 1, 1):
        keys, values = (torch.randn(3, 2, length, 5, generator=generator) for _ in range(2))
        a, b = ours.update(keys, values), theirs.update(keys, values)
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    rows = torch.tensor([2, 0])
    ours.batch_select_indices(rows)
    theirs.batch_select_indices(rows)
    keys, values = (torch.randn(2, 2, 1, 5, generator=generator) for _ in range(2))
    a, b = ours.update(keys, values), theirs.update(keys, values)
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    assert ours.get_seq_length() == theirs.get_seq_length() == 8
    with pytest.raises(ValueError, match="cannot hold 10"):
        ours.update(torch.zeros(2, 2, 2, 5), torch.zeros(2, 2, 2, 5))
