"""The hf engine's sampling: one token per row from [B, V] logits, and that token's log-probability.

The `Completion` contract (base.py): logits / temperature, then top-k, then top-p, then renormalise;
the log-probability is read from that same distribution.

A token is drawn by inverting the row's cumulative distribution with one uniform number per row:
exp(logits - max) once, its running sum in float64 (`cumsum(dtype=float64)` accumulates in
float64 and writes no float32 copy), and a binary search. `torch.multinomial` draws the same
distribution as an exponential race, one exponential number per vocabulary entry from the CPU
generator: at SmolLM2's 49k vocabulary and 128 rows that was 0.13 of the 0.14 s a step's sampling
took on one thread, against 0.015-0.02 s here (bench/RESULTS.md, issue 34, generation). The
log-probability comes from the same sums (logit - max - log sum), so no [B, V] log-softmax is
written; top-k and top-p cost their sort only when set.

Why the draw is exact: u = (1 - r) * total with r uniform in [0, 1) lies in (0, total]; the search
returns the first index whose running sum reaches u, so the index's own term is positive (a
filtered token, whose term is 0, is never drawn) and index i is drawn with probability
term_i / total, up to float64 rounding of the sums.
"""

from __future__ import annotations

import torch

from engines.rollout.base import SamplingParams


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Set to -inf every logit outside the top-k set, then outside the top-p (nucleus) set.

    `logits` is [B, V], already divided by the temperature. top_k <= 0 and top_p >= 1 disable.
    """
    vocab = logits.shape[-1]
    if 0 < top_k < vocab:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        # Drop a token when the mass of the tokens before it already reaches top_p; the first
        # (most likely) token is always kept because the mass before it is 0.
        drop_sorted = (probs.cumsum(dim=-1) - probs) >= top_p
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def sample_next(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick one token per row from [B, V] logits; returns (tokens [B], their log-probs [B])."""
    scaled = logits.float()
    if params.temperature > 0 and params.temperature != 1.0:
        scaled = scaled / params.temperature
    scaled = filter_logits(scaled, params.top_k, params.top_p)
    top = scaled.amax(-1, keepdim=True)
    terms = (scaled - top).exp_()  # unnormalised probabilities, 0 for filtered tokens
    if params.temperature == 0:
        tokens = scaled.argmax(-1, keepdim=True)
        total = terms.sum(-1, keepdim=True, dtype=torch.float64)
    else:
        running = terms.cumsum(-1, dtype=torch.float64)
        total = running[:, -1:]
        uniform = torch.rand(total.shape, dtype=torch.float64, device=total.device, generator=generator)
        tokens = torch.searchsorted(running, (1 - uniform) * total)
    log_probs = scaled.gather(-1, tokens) - top - total.log().float()
    return tokens.squeeze(-1), log_probs.squeeze(-1)
