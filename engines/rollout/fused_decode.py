"""The hf engine's fast decode: a preallocated KV cache and a one-step decode in a few fused operations.

transformers' `DynamicCache` grows by concatenation, copying every layer's cache at every step; a
`PreallocatedLayer` is one buffer per layer for the whole generation, written in place, and attention
reads a view of the columns written so far. Through transformers' modules a one-token step is ~20
operator calls per layer, and on a small model on a CPU the calls, not their arithmetic, dominate.
`FusedDecoder.step` uses one projection for q/k/v and one for gate/up, whose parameters become views
of the fused buffers, so a weight sync into `q_proj.weight` writes the fused buffer too. Only float32,
full-attention models of the `SUPPORTED` classes; for others `build` returns None.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import Cache
from transformers.cache_utils import DynamicLayer
from transformers.models.llama.modeling_llama import rotate_half  # Qwen2's is the same

SUPPORTED = {"Qwen2ForCausalLM", "LlamaForCausalLM"}


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


def _fused_rows(linears: list[torch.nn.Linear], name: str) -> torch.Tensor | None:
    """The `name` tensors of `linears` stacked in one buffer, each made a view of its rows (None: none)."""
    parts = [getattr(layer, name) for layer in linears]
    if all(p is None for p in parts):
        return None
    fused = torch.cat([p.detach() for p in parts])
    start = 0
    for part in parts:
        part.data = fused[start : start + part.shape[0]]
        start += part.shape[0]
    return fused


class FusedDecoder:
    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        config = model.config
        attention = model.model.layers[0].self_attn
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim, self.scaling = attention.head_dim, attention.scaling
        self.intermediate = config.intermediate_size
        self.eps = config.rms_norm_eps
        self.layers: list[tuple] = []
        self.fuse()

    @staticmethod
    def fusable(model: torch.nn.Module) -> bool:
        """Whether `model`'s layers are what the fused steps compute (here and in graph_decode.py)."""
        config = model.config
        if type(model).__name__ not in SUPPORTED or not full_attention_only(config):
            return False
        return getattr(config, "hidden_act", None) == "silu" and not getattr(config, "mlp_bias", False)

    @classmethod
    def build(cls, model: torch.nn.Module) -> FusedDecoder | None:
        """The decoder for `model`, or None where this step would not be exactly its forward (its
        step is exact in float32 only; the fused weights serve graph_decode.py in any dtype)."""
        return cls(model) if cls.fusable(model) and model.dtype == torch.float32 else None

    def fuse(self) -> None:
        """(Re)build the fused buffers; call again after `model.to(device)` replaces the parameters."""
        self.layers = []
        for layer in self.model.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            qkv = [attn.q_proj, attn.k_proj, attn.v_proj]
            self.layers.append(
                (
                    layer.input_layernorm.weight,
                    _fused_rows(qkv, "weight"),
                    _fused_rows(qkv, "bias"),
                    attn.o_proj,
                    layer.post_attention_layernorm.weight,
                    _fused_rows([mlp.gate_proj, mlp.up_proj], "weight"),
                    mlp.down_proj.weight,
                )
            )

    def step(
        self, tokens: torch.Tensor, positions: torch.Tensor, cache, mask: torch.Tensor | None
    ) -> torch.Tensor:
        """Logits [B, V] for `tokens` [B, 1] at `positions` [B, 1]; appends to `cache`'s layers.
        `mask`: bool [B, 1, 1, past + 1] (True = attend), or None for no padding."""
        body = self.model.model
        hidden = body.embed_tokens(tokens)  # [B, 1, H]
        rows, width = hidden.shape[0], hidden.shape[-1]
        cos, sin = body.rotary_emb(hidden, positions)
        cos, sin = cos[:, None], sin[:, None]  # [B, 1, 1, D], against [B, heads, 1, D]
        heads, kv_heads, dim = self.heads, self.kv_heads, self.head_dim
        for (norm_in, qkv_w, qkv_b, o_proj, norm_post, gate_up_w, down_w), layer in zip(
            self.layers, cache.layers, strict=True
        ):
            x = F.rms_norm(hidden, (width,), norm_in, self.eps)
            q, k, v = F.linear(x, qkv_w, qkv_b).split((heads * dim, kv_heads * dim, kv_heads * dim), -1)
            q = q.view(rows, heads, 1, dim)
            k = k.view(rows, kv_heads, 1, dim)
            q = q * cos + rotate_half(q) * sin
            k = k * cos + rotate_half(k) * sin
            keys, values = layer.update(k, v.view(rows, kv_heads, 1, dim))
            # Grouped-query attention for one query: the heads sharing a kv head form its rows.
            scores = torch.matmul(q.view(rows, kv_heads, heads // kv_heads, dim), keys.transpose(-1, -2))
            scores = scores * self.scaling
            if mask is not None:
                scores = scores.masked_fill(~mask, float("-inf"))
            out = torch.matmul(scores.softmax(-1), values).view(rows, 1, heads * dim)
            hidden = hidden + o_proj(out)
            x = F.rms_norm(hidden, (width,), norm_post, self.eps)
            gate, up = F.linear(x, gate_up_w).split(self.intermediate, -1)
            hidden = hidden + F.linear(F.silu(gate) * up, down_w)
        hidden = F.rms_norm(hidden, (width,), body.norm.weight, self.eps)
        return self.model.lm_head(hidden)[:, -1, :]
