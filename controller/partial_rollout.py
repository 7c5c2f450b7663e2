"""Partial rollouts (trainer.partial_rollouts): a draw generated in segments, each one generation call,
so that a weight sync lands between segments and the unfinished responses go on with the new weights.

Every sampled token keeps the version of the weights that sampled it (`token_versions`, the training
layout's response columns, -1 on padding); a row's version, and with it its staleness, is its oldest
token's (`policy_version`). Single-turn only (a multi-turn trajectory's turns are one call on the
rollout worker, workers/multiturn.py).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch

from engines.rollout.base import Completion, SamplingParams
from workers.batch import Batch, prompt_length_of, sampling_of
from workers.rollout_layout import place_rows, rollout_tensors

SEGMENT_SEED_STRIDE = 1_000_033  # each segment samples with a seed of its own


def generate_in_segments(
    prompts: Batch,
    segment_tokens: int,
    generate: Callable[[list[list[int]], SamplingParams], list[Completion]],
    turn: Callable[[], AbstractContextManager[Any]],
    version: Callable[[], int],
    pad: int,
) -> tuple[Batch, float]:
    """The draw's training layout with `token_versions` and `policy_version`, and the seconds spent in
    generation calls. `turn()` holds the rollout workers for one call; `version()` is then theirs."""
    import time

    params = sampling_of(prompts)
    assert params is not None, "a draw carries its SamplingParams (JobSetup.next_prompts)"
    rows = [list(map(int, p)) for p in prompts.non_tensors["prompt_ids"]]
    budget = params.max_new_tokens
    tokens: list[list[int]] = [[] for _ in rows]
    log_probs: list[list[float]] = [[] for _ in rows]
    versions: list[list[int]] = [[] for _ in rows]
    finish = ["length"] * len(rows)
    live, segment, busy = list(range(len(rows))), 0, 0.0
    while live:
        room = min(segment_tokens, *(budget - len(tokens[i]) for i in live))
        seed = None if params.seed is None else params.seed + SEGMENT_SEED_STRIDE * segment
        step = params.model_copy(update={"n": 1, "max_new_tokens": room, "seed": seed})
        with turn():
            current, start = version(), time.perf_counter()
            completions = generate([rows[i] + tokens[i] for i in live], step)
            busy += time.perf_counter() - start
        still = []
        for i, comp in zip(live, completions, strict=True):
            tokens[i] += comp.token_ids
            log_probs[i] += comp.log_probs
            versions[i] += [current] * len(comp.token_ids)
            finish[i] = comp.finish_reason
            if comp.finish_reason == "length" and len(tokens[i]) < budget:
                still.append(i)
        live, segment = still, segment + 1
    merged = [Completion(t, lp, f) for t, lp, f in zip(tokens, log_probs, finish, strict=True)]
    width = prompt_length_of(prompts) or max(len(p) for p in rows)
    tensors = rollout_tensors(rows, merged, width, budget, pad)
    token_versions = torch.full((len(rows), budget), -1, dtype=torch.long)
    place_rows(token_versions, versions)
    tensors["token_versions"] = token_versions
    oldest = [min(v) if v else version() for v in versions]
    tensors["policy_version"] = torch.tensor(oldest, dtype=torch.long)
    return Batch(tensors, prompts.non_tensors, prompts.meta), busy
