"""Log-probabilities (and entropy) of target tokens without a full-vocabulary fp32 tensor.

The vocabulary projection of N tokens is [N, V]; in fp32 for a real batch (N ~ 10^5, V ~ 1.5e5)
that is tens of GiB. We project `chunk` tokens at a time, reduce each chunk to one log-prob (and
one entropy) per token, and wrap every chunk in activation checkpointing so that backward
recomputes the chunk's logits instead of keeping them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint


def _chunk_log_probs(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, temperature: float, with_entropy: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    logits = F.linear(hidden, weight).float()
    if temperature != 1.0:
        logits = logits / temperature
    log_norm = torch.logsumexp(logits, dim=-1)
    picked = logits.gather(-1, targets[:, None]).squeeze(-1)
    log_probs = picked - log_norm
    if not with_entropy:
        return log_probs, torch.zeros_like(log_probs)
    probs = torch.softmax(logits, dim=-1)
    entropy = log_norm - (probs * logits).sum(-1)
    return log_probs, entropy


def token_log_probs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    temperature: float = 1.0,
    with_entropy: bool = False,
    chunk_tokens: int = 1024,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log p(targets[i] | hidden[i]) for hidden [N, H], weight [V, H]; and the entropy when asked."""
    log_probs, entropies = [], []
    for start in range(0, hidden.shape[0], chunk_tokens):
        h, t = hidden[start : start + chunk_tokens], targets[start : start + chunk_tokens]
        if torch.is_grad_enabled() and (h.requires_grad or weight.requires_grad):
            lp, ent = checkpoint(
                _chunk_log_probs, h, weight, t, temperature, with_entropy, use_reentrant=False
            )
        else:
            lp, ent = _chunk_log_probs(h, weight, t, temperature, with_entropy)
        log_probs.append(lp)
        entropies.append(ent)
    log_probs_all = torch.cat(log_probs)
    return log_probs_all, (torch.cat(entropies) if with_entropy else None)
