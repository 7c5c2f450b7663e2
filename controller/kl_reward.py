"""KL in the reward: penalise each token's reward by the policy's divergence from the reference.

    r'_t = r_t - beta * KL_t          (KL_t a per-token estimate, k1 by default: log pi - log pi_ref)

The old log-probs (the policy that sampled) stand for pi. The coefficient beta is either fixed, or
adapted toward a target KL (Ziegler et al., 2019): after each step with observed KL k over n samples,

    e     = clip(k / target - 1, -0.2, 0.2)
    beta <- beta * (1 + e * n / horizon)

so beta grows while the policy drifts further than the target and shrinks while it stays closer,
changing by at most 0.2 * n / horizon per step.
"""

from __future__ import annotations

from typing import Protocol

import torch

from workers.losses.kl import kl_estimate


@torch.no_grad()
def apply_kl_penalty(
    token_rewards: torch.Tensor,
    old_log_probs: torch.Tensor,
    ref_log_probs: torch.Tensor,
    response_mask: torch.Tensor,
    coef: float,
    kl_type: str = "k1",
) -> tuple[torch.Tensor, float]:
    """(penalised token rewards [B, R], the batch KL). Masked positions get no penalty. The batch KL
    is the mean over sequences of each sequence's mean per-token KL: what a KL controller reads."""
    mask = response_mask.to(token_rewards.dtype)
    kl = kl_estimate(old_log_probs, ref_log_probs, kl_type) * mask
    seq_kl = kl.sum(dim=-1) / mask.sum(dim=-1).clamp(min=1)
    return token_rewards - coef * kl, float(seq_kl.mean()) if seq_kl.numel() else 0.0


class KLController(Protocol):
    value: float

    def update(self, current_kl: float, n_steps: int) -> float: ...


class FixedKLController:
    """A constant coefficient."""

    def __init__(self, coef: float) -> None:
        self.value = coef

    def update(self, current_kl: float, n_steps: int) -> float:
        return self.value


class AdaptiveKLController:
    """A coefficient steered toward `target_kl` over `horizon` samples (see the module doc)."""

    def __init__(self, init_coef: float, target_kl: float, horizon: int) -> None:
        if target_kl <= 0 or horizon <= 0:
            raise ValueError(f"adaptive KL needs target_kl > 0 and horizon > 0, got {target_kl}, {horizon}")
        self.value = init_coef
        self.target_kl = target_kl
        self.horizon = horizon

    def update(self, current_kl: float, n_steps: int) -> float:
        error = min(max(current_kl / self.target_kl - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon
        return self.value


def make_kl_controller(coef: float, target_kl: float | None = None, horizon: int = 10_000) -> KLController:
    """Adaptive when a target KL is given, fixed otherwise."""
    if target_kl is None:
        return FixedKLController(coef)
    return AdaptiveKLController(coef, target_kl, horizon)
