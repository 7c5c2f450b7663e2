"""Turning a per-token loss matrix into one scalar that is additive over micro-batches.

Every mode divides by a *global* constant from `GlobalCounts` (the whole batch of one
`forward_backward_batch` call, over every dp rank), never by a count of the micro-batch at hand.
Each mode is therefore a sum of per-row terms over one fixed denominator: summing the results over
any split of the rows gives the whole-batch value, and so do the gradients. The modes differ in how
much weight a token gets:

    token-mean               sum_{i,t} m_it l_it / N_tokens
                             every valid token weighs the same; long answers weigh more in total.
    seq-mean-token-sum       sum_i (sum_t m_it l_it) / N_seqs
                             a sequence's tokens are summed, then sequences averaged.
    seq-mean-token-mean      sum_i (sum_t m_it l_it / sum_t m_it) / N_seqs
                             every sequence weighs the same, whatever its length (GRPO paper).
    seq-mean-token-sum-norm  sum_{i,t} m_it l_it / (N_seqs * R)
                             a constant normaliser, free of any length bias (Dr.GRPO).

One more reduction, not an RL job's choice: `sum`, sum_{i,t} m_it l_it with no denominator (m = 1
on every token when no mask is given), the Tinker API's: each of its losses is a sum over tokens
and data (workers/losses/tinker.py).
"""

from __future__ import annotations

from typing import get_args

import torch

from engines.base import GlobalCounts
from schema.losses import AggMode

AGG_MODES: tuple[str, ...] = get_args(AggMode)


def check_agg_mode(mode: str) -> None:
    """Raise a ValueError naming the choices when `mode` is not an aggregation mode."""
    if mode not in AGG_MODES:
        raise ValueError(f"unknown loss_agg_mode {mode!r}; choose one of {', '.join(AGG_MODES)}")


def aggregate(
    loss_mat: torch.Tensor, mask: torch.Tensor | None, mode: str, counts: GlobalCounts | None = None
) -> torch.Tensor:
    """Reduce `loss_mat` [mb, R] over the valid tokens `mask` [mb, R] to a scalar (see the module doc).

    `sum` alone takes no counts and a mask of None."""
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
    """The share of the global batch's valid tokens where `flags` holds (additive over micro-batches)."""
    return float((flags.to(mask.dtype) * mask).sum()) / max(counts.tokens, 1)


def token_mean(values: torch.Tensor, mask: torch.Tensor, counts: GlobalCounts) -> float:
    """The global token mean of `values`, as this micro-batch's additive share of it."""
    return float((values.detach() * mask.to(values.dtype)).sum()) / max(counts.tokens, 1)
