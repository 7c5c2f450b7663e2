"""The hf engine's sampling: one token per row from [B, V] logits, and its log-probability.

A token is drawn by inverting the row's cumulative distribution with one uniform number per row
(`torch.multinomial` draws one exponential per vocabulary entry, slow on one CPU thread), and its
log-probability comes from the same sums, so no [B, V] log-softmax is written. The draw is exact:
u lies in (0, total] and each search returns the first index whose running sum reaches u, so a token
of mass 0 (filtered) is never drawn.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engines.rollout.base import SamplingParams


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Set to -inf every logit [B, V] outside the top-k set, then outside the top-p set (<= 0 and
    >= 1 disable)."""
    vocab = logits.shape[-1]
    if 0 < top_k < vocab:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        top_p = max(top_p, torch.finfo(logits.dtype).tiny)  # one that is 0 in the logits' dtype drops all
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        # Drop a token when the mass before it reaches top_p: the first token is always kept.
        drop_sorted = (probs.cumsum(dim=-1) - probs) >= top_p
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


BLOCK = 1024  # vocabulary entries per block of `_draw`'s two-level search


def _draw(terms: torch.Tensor, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """One index per row of `terms` [B, V] with probability terms / row sum, and the sums [B, 1] (fp64).

    Block sums pick a block, then a float64 running sum within it picks the entry: no [B, V] float64
    cumsum, which on one CPU thread costs more than the rest of sampling.
    """
    rows, vocab = terms.shape
    size = min(BLOCK, vocab)
    blocks = -(-vocab // size)
    if blocks * size != vocab:
        terms = F.pad(terms, (0, blocks * size - vocab))
    per_block = terms.view(rows, blocks, size)
    mass = per_block.sum(-1).double()  # [B, blocks]
    running = mass.cumsum(-1)
    total = running[:, -1:]
    uniform = torch.rand(total.shape, dtype=torch.float64, device=total.device, generator=generator)
    target = (1 - uniform) * total  # in (0, total]
    block = torch.searchsorted(running, target).clamp(max=blocks - 1)  # [B, 1]
    before = F.pad(running, (1, 0))[:, :-1].gather(-1, block)  # the mass of the blocks before it, < target
    share = ((target - before) / mass.gather(-1, block)).clamp(max=1.0)  # in (0, 1]
    within = per_block[torch.arange(rows, device=terms.device), block.squeeze(-1)].double().cumsum(-1)
    index = torch.searchsorted(within, share * within[:, -1:])
    return block * size + index, total


def sample_next(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick one token per row from [B, V] logits; returns (tokens [B], their log-probs [B])."""
    scaled = logits.float()
    if params.temperature > 0 and params.temperature != 1.0:
        # shifted first, so that a tiny temperature sends the others to -inf, never the top to inf
        scaled = (scaled - scaled.amax(-1, keepdim=True)) / params.temperature
    scaled = filter_logits(scaled, params.top_k, params.top_p)
    top = scaled.amax(-1, keepdim=True)
    terms = (scaled - top).exp_()  # unnormalised probabilities, 0 for filtered tokens
    if params.temperature == 0:
        tokens = scaled.argmax(-1, keepdim=True)
        total = terms.sum(-1, keepdim=True).double()
    else:
        tokens, total = _draw(terms, generator)
    log_probs = scaled.gather(-1, tokens) - top - total.log().float()
    return tokens.squeeze(-1), log_probs.squeeze(-1)
