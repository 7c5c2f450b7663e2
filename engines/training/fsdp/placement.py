"""Where an FSDPEngine's parameters and optimizer state live (engines/training/fsdp/engine.py), as a mixin.

Train and eval modes bring back what `fsdp.param_offload` / `fsdp.optimizer_offload` keep on the
CPU between uses, and put it back when they end.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch


class PlacementMixin:
    """The modes and `to` of the TrainEngine contract (engines/training/base.py), over the engine's `model`,
    `optimizer`, `config`, `device` and `_offloaded`."""

    @contextmanager
    def train_mode(self) -> Iterator[None]:
        self._onload(optimizer=self.optimizer is not None)
        self.model.train()
        try:
            yield
        finally:
            self._offload_as_configured()

    @contextmanager
    def eval_mode(self) -> Iterator[None]:
        self._onload(optimizer=False)
        self.model.eval()
        try:
            yield
        finally:
            self._offload_as_configured()

    def _onload(self, optimizer: bool) -> None:
        onload_optimizer = optimizer and self._offloaded["optimizer"]
        if self._offloaded["model"] or onload_optimizer:
            self.to(str(self.device), model=self._offloaded["model"], optimizer=onload_optimizer)

    def _offload_as_configured(self) -> None:
        f = self.config.fsdp
        optimizer = f.optimizer_offload and self.optimizer is not None
        if f.param_offload or optimizer:
            self.to("cpu", model=f.param_offload, optimizer=optimizer)
            # On a CPU engine the move is a no-op, but the state is tracked the same way.
            self._offloaded["model"] |= f.param_offload
            self._offloaded["optimizer"] |= optimizer

    def to(self, device: str, model: bool = True, optimizer: bool = True) -> None:
        target = torch.device(device)
        offloading = target.type == "cpu" and self.device.type != "cpu"
        if model:
            self.model.to(target)
            self._offloaded["model"] = offloading
        if optimizer and self.optimizer is not None:
            for state in self.optimizer.state.values():
                for key, value in state.items():
                    if isinstance(value, torch.Tensor):
                        state[key] = value.to(target, non_blocking=True)
            self._offloaded["optimizer"] = offloading
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            if offloading:
                torch.cuda.empty_cache()
