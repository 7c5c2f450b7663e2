"""The LoRA layer of every LoRA model in Tandem: `MultiLoraLinear`, a frozen `nn.Linear` (`base_layer`)
plus scaling * B(A(dropout(x))) as PEFT computes it, from its own adapter (`add_own`: parameters an
RL job's FSDP engine shards and checkpoints; `adapters_off` skips them) or from a table of callers'
adapters (`adapters[key]`, the adapter engine's: one base, many adapters), where `rows(layers,
segments)` says which contiguous rows use which, so autograd gives each adapter its own gradient.
PEFT's own layers refuse mixed-adapter batches in training; the names and saved format stay PEFT's.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from engines.training.lora_targets import PEFT_PREFIX, base_module

ATTN_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
UNEMBED_MODULES = ("lm_head",)

Segment = tuple[str | None, int]  # (adapter key or None for the base, number of rows)


@dataclass
class LayerAdapter:
    a: torch.Tensor  # [rank, in]
    b: torch.Tensor  # [out, rank]
    scaling: float


def lora_delta(
    x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scaling: float, dropout: nn.Module | None = None
) -> torch.Tensor:
    """scaling * B(A(dropout(x))) in PEFT's order and dtypes (x cast to the adapter's dtype first),
    so that an adapter computes here exactly what it computes in PEFT."""
    x = x.to(a.dtype)
    if dropout is not None:
        x = dropout(x)
    return nn.functional.linear(nn.functional.linear(x, a), b) * scaling


class MultiLoraLinear(nn.Module):
    """A frozen linear layer plus its own adapter and any number of table adapters (module docstring)."""

    def __init__(self, base: nn.Linear) -> None:
        super().__init__()
        self.base_layer = base
        self.adapters: dict[str, LayerAdapter] = {}
        self.segments: list[Segment] | None = None
        self.lora_A: nn.Linear | None = None
        self.lora_B: nn.Linear | None = None
        self.lora_dropout: nn.Module | None = None
        self.scaling = 1.0
        self.own_on = True

    @property
    def in_features(self) -> int:
        return self.base_layer.in_features

    @property
    def out_features(self) -> int:
        return self.base_layer.out_features

    def add_own(self, rank: int, scaling: float, dropout: float) -> None:
        """This layer's own trainable adapter, drawn from the global RNG in PEFT's order (both layers
        construct, then A Kaiming-uniform, B zero), so a seed gives PEFT's adapter; B = 0 is the base."""
        self.lora_A = nn.Linear(self.in_features, rank, bias=False)
        self.lora_B = nn.Linear(rank, self.out_features, bias=False)
        nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5))
        nn.init.zeros_(self.lora_B.weight)
        self.lora_dropout = nn.Dropout(dropout) if dropout > 0 else None
        self.scaling = scaling

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base_layer(x)
        if self.segments:
            return self._table_forward(x, y, self.segments)
        if self.lora_A is None or not self.own_on:
            return y
        delta = lora_delta(x, self.lora_A.weight, self.lora_B.weight, self.scaling, self.lora_dropout)
        return (y + delta).to(y.dtype)

    def _table_forward(self, x: torch.Tensor, y: torch.Tensor, segments: list[Segment]) -> torch.Tensor:
        if all(key is None or key not in self.adapters for key, _ in segments):
            return y
        if sum(n for _, n in segments) != x.shape[0]:
            raise RuntimeError(
                f"segments cover {sum(n for _, n in segments)} rows, the batch has {x.shape[0]}"
            )
        # split, not one slice per segment: a slice's backward writes a zero tensor of the whole
        # batch per segment, split's backward one concatenation
        deltas = []
        for (key, _), part in zip(segments, x.split([n for _, n in segments], dim=0), strict=True):
            adapter = self.adapters.get(key)
            if adapter is None:
                deltas.append(torch.zeros(part.shape[:-1] + (y.shape[-1],), dtype=y.dtype, device=y.device))
            else:
                deltas.append(lora_delta(part, adapter.a, adapter.b, adapter.scaling).to(y.dtype))
        return y + torch.cat(deltas, dim=0)


def linear_modules(model: nn.Module, short_names: tuple[str, ...]) -> list[str]:
    """Paths of the `nn.Linear` modules (or injected ones) whose last component is in `short_names`."""
    return sorted(
        name
        for name, m in model.named_modules()
        if isinstance(m, (nn.Linear, MultiLoraLinear))
        and name.rsplit(".", 1)[-1] in short_names
        and not name.endswith(".base_layer")
    )


def inject(model: nn.Module, paths: list[str]) -> dict[str, MultiLoraLinear]:
    """Wrap each linear layer at `paths` (idempotent); returns path -> layer for all wrapped ones."""
    for path in paths:
        parent_path, _, child = path.rpartition(".")
        parent = model.get_submodule(parent_path) if parent_path else model
        layer = getattr(parent, child)
        if isinstance(layer, nn.Linear):
            setattr(parent, child, MultiLoraLinear(layer))
    return {name: m for name, m in model.named_modules() if isinstance(m, MultiLoraLinear)}


@contextmanager
def _set(layers: Iterable[MultiLoraLinear], name: str, value: object, after: object) -> Iterator[None]:
    layers = list(layers)
    for layer in layers:
        setattr(layer, name, value)
    try:
        yield
    finally:
        for layer in layers:
            setattr(layer, name, after)


def adapters_off(model: nn.Module) -> AbstractContextManager[None]:
    """Within the block every layer's own adapter passes through: `model` computes as its base."""
    return _set((m for m in model.modules() if isinstance(m, MultiLoraLinear)), "own_on", False, True)


def rows(layers: dict[str, MultiLoraLinear], segments: list[Segment]) -> AbstractContextManager[None]:
    """Within the block every wrapped layer applies table adapter `key` to its segment of rows."""
    return _set(layers.values(), "segments", segments, None)


def init_adapter(
    layers: dict[str, MultiLoraLinear], paths: list[str], rank: int, seed: int, device: torch.device
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Fresh fp32 (A, B) leaves per layer from `seed`, as PEFT initialises them: A Kaiming-uniform, B zero."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for path in paths:
        base = layers[path].base_layer
        a = torch.empty(rank, base.in_features)
        nn.init.kaiming_uniform_(a, a=math.sqrt(5), generator=gen)
        b = torch.zeros(base.out_features, rank)
        out[path] = (a.to(device).requires_grad_(True), b.to(device).requires_grad_(True))
    return out


def attach(
    layers: dict[str, MultiLoraLinear],
    key: str,
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]],
    scaling: float,
) -> None:
    for path, (a, b) in weights.items():
        layers[path].adapters[key] = LayerAdapter(a, b, scaling)


def detach(layers: dict[str, MultiLoraLinear], key: str) -> None:
    for layer in layers.values():
        layer.adapters.pop(key, None)


def peft_tensors(weights: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """PEFT's saved names: base_model.model.<path>.lora_A.weight / .lora_B.weight."""
    out = {}
    for path, (a, b) in weights.items():
        out[f"{PEFT_PREFIX}{path}.lora_A.weight"] = a.detach()
        out[f"{PEFT_PREFIX}{path}.lora_B.weight"] = b.detach()
    return out


def from_peft_tensors(tensors: dict[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """The inverse of `peft_tensors` (also of PEFT's '.lora_A.default.weight' names); others left out."""
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in tensors.items():
        parsed = base_module(name)
        if parsed is not None:
            parts.setdefault(parsed[0], {})[parsed[1]] = tensor
    missing = [path for path, ab in parts.items() if set(ab) != {"A", "B"}]
    if missing:
        raise ValueError(f"adapter layer '{missing[0]}' lacks its lora_A or lora_B tensor")
    return {path: (ab["A"], ab["B"]) for path, ab in sorted(parts.items())}
