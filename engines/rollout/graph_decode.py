"""The hf engine's decode on CUDA: one step of fixed shapes over a static KV cache, replayed as a CUDA graph.

Through transformers' modules one token of a 24-layer model is several hundred kernel launches from
Python, so decode on a GPU is bound by the launches, not the card. `StaticDecoder` keeps every tensor a
step touches at a fixed address and shape: the batch's keys and values in one buffer per layer of
`capacity` positions, written at `position` (a device scalar) with `index_copy_`; attention reads all
`capacity` positions under a mask of the prompt's real tokens and the positions written so far. One
step is then captured once as a CUDA graph and replayed per token: one launch instead of hundreds.
The engine keeps a few graphs, by (rows rounded up to a power of two, capacity), for later calls of
those shapes, and drops them when the weights move;
weight syncs and merged adapters write the same tensors in place, so the graph sees them.

On a CPU (tests) or when capture fails the same step runs eagerly. Only full-attention models of the
`SUPPORTED` classes; no sliding windows, no grammar masks (those keep the step-by-step loop).
"""

from __future__ import annotations

import logging

import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from engines.rollout.fused_decode import SUPPORTED, full_attention_only

log = logging.getLogger(__name__)
CAPACITY_STEP = 128  # capacities round up to this, so calls with near prompt lengths share a graph


def supports(model: torch.nn.Module) -> bool:
    return type(model).__name__ in SUPPORTED and full_attention_only(model.config)


def capacity_for(positions: int) -> int:
    return -(-positions // CAPACITY_STEP) * CAPACITY_STEP


def rows_for(rows: int) -> int:
    """The batch a decoder is built for: the next power of two."""
    return 1 << (rows - 1).bit_length()


class StaticDecoder:
    """One decode step for `rows` rows over `capacity` positions; `capture`: as a CUDA graph."""

    def __init__(self, model: torch.nn.Module, rows: int, capacity: int, capture: bool) -> None:
        self.model, self.rows, self.capacity = model, rows, capacity
        config = model.config
        attention = model.model.layers[0].self_attn
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = attention.head_dim
        param = next(model.parameters())
        device, dtype = param.device, param.dtype
        shape = (rows, self.kv_heads, capacity, self.head_dim)
        # Zeroed: a masked position's value is still multiplied by its weight 0, and 0 * NaN is NaN.
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in model.model.layers]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in model.model.layers]
        self.tokens = torch.zeros((rows, 1), dtype=torch.long, device=device)
        self.positions = torch.zeros((rows, 1), dtype=torch.long, device=device)
        self.position = torch.zeros(1, dtype=torch.long, device=device)  # the cache column written
        self.attend = torch.zeros((rows, capacity), dtype=torch.bool, device=device)  # real tokens
        self.span = torch.arange(capacity, device=device)
        self.capture = capture and device.type == "cuda"
        self.graph: torch.cuda.CUDAGraph | None = None
        self.logits: torch.Tensor | None = None

    def key(self) -> tuple[int, int]:
        return self.rows, self.capacity

    def start(self, cache, prompt_mask: torch.Tensor) -> None:
        """Take a prefilled cache (`PreallocatedLayer`s, one row per row) of the prompts [B, P]."""
        width = prompt_mask.shape[1]
        for layer, keys, values in zip(cache.layers, self.keys, self.values, strict=True):
            keys[:, :, :width] = layer.keys
            values[:, :, :width] = layer.values
            values[:, :, width:] = 0
        self.attend[:, :width] = prompt_mask.bool()
        self.attend[:, width:] = True

    def step(self, tokens: torch.Tensor, positions: torch.Tensor, column: int) -> torch.Tensor:
        """Logits [B, V] of `tokens` [B, 1] at rotary `positions` [B, 1], cached at `column`."""
        self.tokens.copy_(tokens)
        self.positions.copy_(positions)
        self.position.fill_(column)
        if not self.capture:
            return self._forward()
        if self.graph is None:
            self.graph = self._captured()
            if self.graph is None:
                return self._forward()
        self.graph.replay()
        return self.logits

    def _captured(self) -> torch.cuda.CUDAGraph | None:
        """The step as a graph, after warm-up runs on a side stream (each writes the same column the
        replay writes, with the same inputs); None, and eager steps from then on, if capture fails."""
        try:
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(2):
                    self._forward()
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                self.logits = self._forward()
            return graph
        except Exception as err:  # a model whose step cannot be captured still decodes
            log.warning(
                "decode step not captured as a CUDA graph (%s: %s); running it eagerly",
                type(err).__name__,
                err,
            )
            self.capture = False
            return None

    def _forward(self) -> torch.Tensor:
        body = self.model.model
        rows, heads, kv_heads, dim = self.rows, self.heads, self.kv_heads, self.head_dim
        hidden = body.embed_tokens(self.tokens)  # [B, 1, H]
        cos, sin = body.rotary_emb(hidden, self.positions)
        mask = (self.attend & (self.span <= self.position))[:, None, None, :]  # [B, 1, 1, C]
        for layer, keys, values in zip(body.layers, self.keys, self.values, strict=True):
            attn = layer.self_attn
            x = layer.input_layernorm(hidden)
            q = attn.q_proj(x).view(rows, 1, heads, dim).transpose(1, 2)
            k = attn.k_proj(x).view(rows, 1, kv_heads, dim).transpose(1, 2)
            v = attn.v_proj(x).view(rows, 1, kv_heads, dim).transpose(1, 2)
            q, k = apply_rotary_pos_emb(q, k, cos, sin)
            keys.index_copy_(2, self.position, k)
            values.index_copy_(2, self.position, v)
            # Grouped-query attention for one query: the heads sharing a kv head form its rows.
            scores = torch.matmul(q.reshape(rows, kv_heads, heads // kv_heads, dim), keys.transpose(-1, -2))
            scores = (scores * attn.scaling).masked_fill(~mask, float("-inf"))
            probs = scores.softmax(-1, dtype=torch.float32).to(values.dtype)
            out = torch.matmul(probs, values).reshape(rows, 1, heads * dim)
            hidden = hidden + attn.o_proj(out)
            hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
        return self.model.lm_head(body.norm(hidden))[:, -1, :]
