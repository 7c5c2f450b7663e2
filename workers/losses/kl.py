"""Per-token estimators of KL(pi || pi_ref) from the sampled tokens' log-probs, d = log pi - log pi_ref:

k1 = d  (unbiased, can be negative)    k2 = d^2 / 2  (biased, >= 0)
k3 = exp(-d) - 1 + d  (unbiased, >= 0, "low_var_kl"; clamped to [-10, 10])
"""

from __future__ import annotations

from typing import get_args

import torch

from schema.losses import KLType

KL_TYPES: tuple[str, ...] = get_args(KLType)
_ALIASES = {"low_var_kl": "k3", "kl": "k1", "mse": "k2"}

# exp of a log-ratio past this overflows in bf16/fp16; the clamp only bites for absurd policies.
MAX_LOG_RATIO = 20.0
_K3_BOUND = 10.0


def kl_estimate(log_probs: torch.Tensor, ref_log_probs: torch.Tensor, kl_type: str) -> torch.Tensor:
    """The per-token KL estimate of `kl_type` (k1, k2, k3 or the alias low_var_kl); same shape as inputs."""
    kind = _ALIASES.get(kl_type, kl_type)
    diff = log_probs - ref_log_probs
    if kind == "k1":
        return diff
    if kind == "k2":
        return 0.5 * diff.square()
    if kind == "k3":
        neg = (-diff).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
        return (neg.exp() - neg - 1.0).clamp(-_K3_BOUND, _K3_BOUND)
    raise ValueError(f"unknown KL estimator {kl_type!r}; choose one of {', '.join(KL_TYPES)} (or low_var_kl)")
