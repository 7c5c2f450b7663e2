"""Turning a per-token loss matrix into one scalar that is additive over micro-batches.

Every mode divides by a global constant (`GlobalCounts`: the whole batch, over every dp rank), never
by a count of the micro-batch at hand, so any split of the rows sums to the whole-batch value:

    token-mean               sum_{i,t} m_it l_it / N_tokens
    seq-mean-token-sum       sum_i (sum_t m_it l_it) / N_seqs
    seq-mean-token-mean      sum_i (sum_t m_it l_it / sum_t m_it) / N_seqs     (GRPO)
    seq-mean-token-sum-norm  sum_{i,t} m_it l_it / (N_seqs * R)               (Dr.GRPO)
    sum                      sum_{i,t} m_it l_it, no denominator (the Tinker API's losses)
"""

from __future__ import annotations

from typing import get_args

import torch

from engines.training.base import GlobalCounts
from schema.losses import AggMode

AGG_MODES: tuple[str, ...] = get_args(AggMode)


def check_agg_mode(mode: str) -> None:
    if mode not in AGG_MODES:
        raise ValueError(f"unknown loss_agg_mode {mode!r}; choose one of {', '.join(AGG_MODES)}")


def aggregate(
    loss_mat: torch.Tensor, mask: torch.Tensor | None, mode: str, counts: GlobalCounts | None = None
) -> torch.Tensor:
    """Reduce `loss_mat` [mb, R] over the valid tokens `mask` to a scalar (`sum` takes no counts and
    may take no mask)."""
    if mode == "sum":
        return loss_mat.sum() if mask is None else (loss_mat * mask.to(loss_mat.dtype)).sum()
    check_agg_mode(mode)
    if mask is None or counts is None:
        raise ValueError(f"loss_agg_mode {mode!r} needs the valid-token mask and the global counts")
    mask = mask.to(loss_mat.dtype)
    masked = loss_mat * mask
    if mode == "token-mean":
        # max(.., 1): a global batch with no valid token yields 0, not NaN.
        return masked.sum() / max(counts.tokens, 1)
    if mode == "seq-mean-token-sum":
        return masked.sum() / max(counts.sequences, 1)
    if mode == "seq-mean-token-mean":
        per_seq = masked.sum(dim=-1) / mask.sum(dim=-1).clamp(min=1)
        return per_seq.sum() / max(counts.sequences, 1)
    if mode == "seq-mean-token-sum-norm":
        return masked.sum() / max(counts.sequences * counts.response_width, 1)
    raise AssertionError(f"loss_agg_mode {mode!r} is declared but has no reduction")


def token_fraction(flags: torch.Tensor, mask: torch.Tensor, counts: GlobalCounts) -> float:
    """The share of the global batch's valid tokens where `flags` holds."""
    return float((flags.to(mask.dtype) * mask).sum()) / max(counts.tokens, 1)


def token_mean(values: torch.Tensor, mask: torch.Tensor, counts: GlobalCounts) -> float:
    """The global token mean of `values`, as this micro-batch's additive share of it."""
    return float((values.detach() * mask.to(values.dtype)).sum()) / max(counts.tokens, 1)
