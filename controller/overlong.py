"""Over-long responses (DAPO, Yu et al. 2025): a response that stopped at its token budget L_max
(`RolloutSpec.response_budget`) never finished its answer, so its reward says little about it.

    soft penalty   R_len(y) = -f * max(0, |y| - (L_max - L_c)) / L_c added to the score (buffer L_c)
    filter         truncated responses leave the loss (response mask 0); their scores still enter
                   their group's baseline

Scores first, then the filter: the penalty shapes what the advantages see, the filter what is trained.
"""

from __future__ import annotations

import torch

from controller.step_math import response_lengths, with_tensors
from schema.training import OverlongSpec
from workers.batch import Batch


def overlong_penalty(lengths: torch.Tensor, max_new_tokens: int, buffer: int, factor: float) -> torch.Tensor:
    """R_len of the module doc for each length [B]; zeros when the buffer is 0."""
    if buffer == 0:
        return torch.zeros(lengths.shape, dtype=torch.float32)
    excess = (lengths.float() - (max_new_tokens - buffer)).clamp(min=0)
    return -factor * excess / buffer


def apply_overlong(
    batch: Batch, scores: torch.Tensor, cfg: OverlongSpec, max_new_tokens: int
) -> tuple[Batch, torch.Tensor, dict[str, float]]:
    """The penalised scores and the filtered batch, with overlong/truncated_frac, masked_frac and
    penalty_mean; `max_new_tokens` is the samples' budget L_max."""
    t = batch.tensors
    metrics: dict[str, float] = {}
    if "truncated" in t.keys():
        metrics["overlong/truncated_frac"] = float(t["truncated"].float().mean())
    if cfg.penalty_buffer:
        penalty = overlong_penalty(
            response_lengths(batch), max_new_tokens, cfg.penalty_buffer, cfg.penalty_factor
        )
        scores = scores + penalty.to(scores.dtype)
        metrics["overlong/penalty_mean"] = float(penalty.mean())
    if cfg.filter:
        if "truncated" not in t.keys():
            raise KeyError("algorithm.overlong.filter needs the rollout's 'truncated' flags in the batch")
        keep = (t["truncated"] == 0).unsqueeze(1).to(t["response_mask"].dtype)
        batch = with_tensors(batch, response_mask=t["response_mask"] * keep)
        metrics["overlong/masked_frac"] = float(t["truncated"].float().mean())
    return batch, scores, metrics
