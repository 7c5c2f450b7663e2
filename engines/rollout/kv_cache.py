"""The hf engine's KV cache: one buffer per layer for the whole generation, written in place.

transformers' `DynamicCache` grows by concatenation, copying every layer's cache at every step;
here a step writes its one column and attention reads a view of the columns written so far.
"""

from __future__ import annotations

import torch
from transformers import Cache
from transformers.cache_utils import DynamicLayer


class PreallocatedLayer(DynamicLayer):
    """A full-attention layer's keys and values in buffers of `capacity` positions."""

    def __init__(self, capacity: int) -> None:
        super().__init__()
        self.capacity = capacity
        self.length = 0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self._keys = self._buffer(key_states)
        self._values = self._buffer(value_states)
        self.is_initialized = True

    def _buffer(self, states: torch.Tensor) -> torch.Tensor:
        batch, heads, _, dim = states.shape
        return states.new_empty(batch, heads, self.capacity, dim)

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        end = self.length + key_states.shape[-2]
        if end > self.capacity:
            raise ValueError(f"KV cache of {self.capacity} positions cannot hold {end}")
        self._keys[:, :, self.length : end] = key_states
        self._values[:, :, self.length : end] = value_states
        self.length = end
        self.keys, self.values = self._keys[:, :, :end], self._values[:, :, :end]
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:  # transformers' layer protocol
        return self.capacity

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.is_initialized:
            self._keys, self._values = self._keys[indices], self._values[indices]
            self.keys, self.values = self._keys[:, :, : self.length], self._values[:, :, : self.length]


def full_attention_only(config) -> bool:
    """Whether every layer attends to the whole past (no sliding window): what this cache serves."""
    text = config.get_text_config(decoder=True)
    types = getattr(text, "layer_types", None) or ["full_attention"]
    return all(kind == "full_attention" for kind in types)


def preallocated_cache(config, capacity: int) -> Cache:
    layers = config.get_text_config(decoder=True).num_hidden_layers
    return Cache(layers=[PreallocatedLayer(capacity) for _ in range(layers)])
