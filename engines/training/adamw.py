"""The one AdamW of Tandem, for an RL job's FSDPEngine (its `OptimizerConfig`, the schedule's lr) and a
Tinker session's adapter (the SDK's `AdamParams` of each call), both mapped to `AdamWSettings`. A step
densifies sparse gradients, clips the global norm, is skipped when that norm is not finite (a NaN
would poison Adam's moments for good), and zeroes the gradients.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from schema.engine import OptimizerConfig


@dataclass(frozen=True)
class AdamWSettings:
    lr: float
    betas: tuple[float, float]
    eps: float
    weight_decay: float
    grad_clip: float | None  # max global grad norm; None (or 0) = no clipping

    @classmethod
    def of(cls, config: OptimizerConfig) -> AdamWSettings:
        return cls(config.lr, tuple(config.betas), config.eps, config.weight_decay, config.grad_clip)

    @classmethod
    def from_adam_params(cls, adam: Mapping[str, Any]) -> AdamWSettings:
        """The Tinker SDK's `AdamParams` (its defaults where a key is absent; grad_clip_norm 0 = none)."""
        return cls(
            lr=float(adam.get("learning_rate", 1e-4)),
            betas=(float(adam.get("beta1", 0.9)), float(adam.get("beta2", 0.95))),
            eps=float(adam.get("eps", 1e-12)),
            weight_decay=float(adam.get("weight_decay", 0.0)),
            grad_clip=float(adam.get("grad_clip_norm", 0.0)) or None,
        )


def build_adamw(params: Sequence[torch.Tensor], settings: AdamWSettings) -> torch.optim.AdamW:
    # fused: one kernel over all parameters instead of a dozen foreach ops, each dispatched
    # through DTensor.
    return torch.optim.AdamW(
        list(params),
        lr=settings.lr,
        betas=settings.betas,
        eps=settings.eps,
        weight_decay=settings.weight_decay,
        fused=True,
    )


def adamw_step(
    optimizer: torch.optim.Optimizer,
    params: Sequence[torch.Tensor],
    settings: AdamWSettings,
    override: bool = False,
) -> float:
    """One step on the gradients of `params`; returns the global grad norm before clipping.

    With `override`, `settings` replace the optimizer's own for this one step and the old ones come
    back after it (a learning-rate schedule keeps owning the learning rate). The caller counts a
    skipped step from the returned norm (`math.isfinite`)."""
    with_grad = [p for p in params if p.grad is not None]
    for param in with_grad:  # a tied embedding's gradient is sparse when its head had none (fsdp/modules.py)
        if param.grad.is_sparse:
            param.grad = param.grad.to_dense()
    norm = torch.nn.utils.clip_grad_norm_(with_grad, max_norm=settings.grad_clip or math.inf, foreach=True)
    if isinstance(norm, DTensor):
        norm = norm.full_tensor()
    grad_norm = float(norm)
    if math.isfinite(grad_norm):
        saved = [dict(group) for group in optimizer.param_groups]
        for group in optimizer.param_groups if override else []:
            group.update(
                lr=settings.lr, betas=settings.betas, eps=settings.eps, weight_decay=settings.weight_decay
            )
        try:
            optimizer.step()
        finally:
            for group, values in zip(optimizer.param_groups, saved, strict=True):
                group.update(values)
    optimizer.zero_grad(set_to_none=True)
    return grad_norm
