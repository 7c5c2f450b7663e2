"""The optimizer and learning-rate schedule of an FSDPEngine (engines/training/fsdp/engine.py), as a mixin.

Tandem's one AdamW (engines/training/adamw.py) under a warmup-then-constant or warmup-then-cosine schedule. A
low-level client may hand one step its own AdamW settings (`optimizer_step(params)`).
"""

from __future__ import annotations

import math

import torch

from engines.training.adamw import AdamWSettings, adamw_step, build_adamw
from schema.engine import OptimizerConfig


class OptimizerMixin:
    """The optimisation half of the TrainEngine contract (engines/training/base.py), over the engine's
    `model`, `optimizer`, `scheduler`, `config` and `skipped_steps`."""

    def _build_optimizer(self) -> torch.optim.Optimizer:
        params = [p for p in self.model.parameters() if p.requires_grad]
        return build_adamw(params, AdamWSettings.of(self.config.optim))

    def _build_scheduler(self, optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LambdaLR:
        s = self.config.scheduler
        warmup, total = s.resolved_warmup_steps, s.total_steps

        def factor(step: int) -> float:
            if step < warmup:
                return (step + 1) / (warmup + 1)
            if s.kind == "constant":
                return 1.0
            progress = min(1.0, (step - warmup) / max(1, total - warmup))
            return s.min_lr_ratio + (1 - s.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

        return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)

    def optimizer_zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def optimizer_step(self, params: OptimizerConfig | None = None) -> float:
        settings = AdamWSettings.of(params or self.config.optim)
        grad_norm = adamw_step(
            self.optimizer, list(self.model.parameters()), settings, override=params is not None
        )
        if not math.isfinite(grad_norm):
            self.skipped_steps += 1
        return grad_norm

    def lr_scheduler_step(self) -> float:
        self.scheduler.step()
        return float(self.scheduler.get_last_lr()[0])

    @property
    def learning_rate(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"]) if self.optimizer else 0.0

    def set_learning_rate(self, lr: float) -> None:
        """Change the base learning rate (a hyper-parameter edit); the schedule's factor still applies."""
        for group, base in zip(self.optimizer.param_groups, self.scheduler.base_lrs, strict=True):
            group["lr"] = group["lr"] / base * lr if base else lr
        self.scheduler.base_lrs = [lr for _ in self.scheduler.base_lrs]
