"""LoRA adapters merged into the hf engine's weights (W = W0 + scaling * B @ A), so decoding runs at the
base model's speed. Each merge is recomputed in fp32 from a copy of the base weight: merging onto the
previous merge would accumulate rounding over many syncs.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from engines.training.lora_targets import base_module
from engines.training.multi_lora import from_peft_tensors


def scaling_of(config: dict) -> float:
    """alpha / r from a PEFT adapter_config.json (rsLoRA: alpha / sqrt(r))."""
    rank = config["r"]
    return config["lora_alpha"] / (rank**0.5 if config.get("use_rslora") else rank)


class AdapterMerger:
    """Merges successive adapters into `weights` (HF name -> live tensor), each onto the base."""

    def __init__(self) -> None:
        self.base: dict[str, torch.Tensor] = {}

    @torch.no_grad()
    def merge(self, weights: dict[str, torch.Tensor], config: dict, named_tensors: Iterable) -> int:
        """Write base + scaling * B @ A into every adapted layer's weight; returns how many."""
        scaling = scaling_of(config)
        tensors = dict(named_tensors)
        stray = [name for name in tensors if base_module(name) is None]
        if stray:
            raise KeyError(
                f"'{stray[0]}' is not a LoRA tensor (expected PEFT names ending in lora_A/lora_B.weight)"
            )
        pairs = from_peft_tensors(tensors)
        for module, (a, b) in pairs.items():
            key = f"{module}.weight"
            target = weights.get(key)
            if target is None:
                raise KeyError(f"the adapter adapts '{module}', which the rollout model does not have")
            a, b = a.to(target.device, torch.float32), b.to(target.device, torch.float32)
            if (b.shape[0], a.shape[1]) != tuple(target.shape):
                raise ValueError(
                    f"adapter layer '{module}' is [{b.shape[0]}, {a.shape[1]}] but the rollout model's "
                    f"weight is {list(target.shape)}"
                )
            base = self.base.setdefault(key, target.detach().clone())
            target.copy_(torch.addmm(base.float(), b, a, alpha=scaling))
        return len(pairs)

    def to(self, device: torch.device | str) -> None:
        """Follow the weights when the engine moves them (release / resume memory)."""
        self.base = {k: v.to(device) for k, v in self.base.items()}
