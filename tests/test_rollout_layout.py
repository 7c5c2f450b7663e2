"""The rank-side pieces around a generation: the training layout of the completions
(workers/rollout_layout.py `rollout_tensors`) and the thread count a small model runs with (engines/threads.py)."""

from __future__ import annotations

import json
import random

import pytest
import torch

from engines.rollout.base import Completion
from engines.threads import (
    ONE_THREAD_BELOW_HIDDEN,
    hidden_size_of,
    limit_threads_for_model,
)
from workers.rollout_layout import rollout_tensors as _rollout_tensors


def row_by_row(
    prompts: list[list[int]], completions: list[Completion], width: int, new: int, pad: int
) -> dict:
    """The layout written one row and one token at a time: the reference."""
    rows = len(prompts)
    out = {
        "input_ids": torch.full((rows, width + new), pad, dtype=torch.long),
        "attention_mask": torch.zeros((rows, width + new), dtype=torch.long),
        "rollout_log_probs": torch.zeros(rows, new),
    }
    for i, (prompt, comp) in enumerate(zip(prompts, completions, strict=True)):
        for j, token in enumerate(prompt):
            out["input_ids"][i, width - len(prompt) + j] = token
            out["attention_mask"][i, width - len(prompt) + j] = 1
        for j, (token, log_prob) in enumerate(zip(comp.token_ids[:new], comp.log_probs, strict=False)):
            out["input_ids"][i, width + j] = token
            out["attention_mask"][i, width + j] = 1
            out["rollout_log_probs"][i, j] = log_prob
    out["responses"] = out["input_ids"][:, width:]
    out["response_mask"] = out["attention_mask"][:, width:]
    out["weight_version"] = torch.tensor([c.weight_version for c in completions])
    out["truncated"] = torch.tensor([int(c.finish_reason == "length") for c in completions])
    return out


def test_prompts_are_left_padded_and_responses_right_padded():
    rng = random.Random(0)
    for _ in range(30):
        rows, width, new = rng.randint(1, 12), rng.randint(1, 10), rng.randint(1, 8)
        prompts = [[rng.randint(1, 99) for _ in range(rng.randint(1, width))] for _ in range(rows)]
        completions = []
        for _ in range(rows):
            length = rng.randint(0, new + 2)  # empty, short, and longer than the budget
            completions.append(
                Completion(
                    [rng.randint(1, 99) for _ in range(length)],
                    [-rng.random() for _ in range(length)],
                    rng.choice(["stop", "length"]),
                    weight_version=rng.randint(0, 3),
                )
            )
        got = _rollout_tensors(prompts, completions, width, new, pad=0)
        want = row_by_row(prompts, completions, width, new, pad=0)
        assert sorted(got.keys()) == sorted(want)
        for key, value in want.items():
            assert got[key].dtype == value.dtype and torch.equal(got[key], value), key


def test_a_prompt_longer_than_the_width_is_refused():
    with pytest.raises(ValueError, match="3 tokens is longer than max_prompt_length=2"):
        _rollout_tensors([[1, 2, 3]], [Completion([4], [-0.1], "stop")], width=2, new_tokens=4, pad=0)


def test_a_small_model_computes_on_one_thread(tmp_path):
    small, wide, vlm = tmp_path / "small", tmp_path / "wide", tmp_path / "vlm"
    for folder, config in (
        (small, {"hidden_size": ONE_THREAD_BELOW_HIDDEN - 1}),
        (wide, {"hidden_size": ONE_THREAD_BELOW_HIDDEN}),
        (vlm, {"text_config": {"hidden_size": 64}}),
    ):
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps(config))
    assert hidden_size_of(vlm) == 64 and hidden_size_of(tmp_path) is None
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert limit_threads_for_model(wide) == 2 and torch.get_num_threads() == 2
        assert limit_threads_for_model(tmp_path) == 2  # no config.json: unknown size, left as it is
        assert limit_threads_for_model(small) == 1 and torch.get_num_threads() == 1
        torch.set_num_threads(2)
        assert limit_threads_for_model(vlm) == 1
    finally:
        torch.set_num_threads(before)
