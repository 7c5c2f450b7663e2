"""The hf engine's decode on CUDA: one step of fixed shapes over a static KV cache, replayed as a CUDA graph.

Through transformers' modules one token of a 24-layer model is several hundred kernel launches from
Python, so decode on a GPU is bound by the launches, not the card. `StaticDecoder` keeps every tensor a
step touches at a fixed address and shape: the batch's keys and values in one buffer per layer of
`capacity` positions, written at `position` (a device scalar) with `index_copy_`; attention reads all
`capacity` positions under a mask of the prompt's real tokens and the positions written so far. One
step is then captured once as a CUDA graph and replayed per token: one launch instead of hundreds.
The step itself runs on `FusedDecoder`'s fused weights in a fraction of the modules' kernels: a
graph removes the launches' CPU cost, not the GPU's cost per kernel. The engine keeps a few graphs, by (rows rounded up to a power of two, capacity), for later calls of
those shapes, and drops them when the weights move;
weight syncs and merged adapters write the same tensors in place, so the graph sees them.

On a CPU (tests) or when capture fails the same step runs eagerly. Only models `FusedDecoder.fusable`
takes; no grammar masks (those keep the step-by-step loop).
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from engines.rollout.fused_decode import FusedDecoder

log = logging.getLogger(__name__)
CAPACITY_STEP = 128  # capacities round up to this, so calls with near prompt lengths share a graph


def capacity_for(positions: int) -> int:
    return -(-positions // CAPACITY_STEP) * CAPACITY_STEP


def rows_for(rows: int) -> int:
    """The batch a decoder is built for: the next power of two."""
    return 1 << (rows - 1).bit_length()


class StaticDecoder:
    """One decode step for `rows` rows over `capacity` positions; `capture`: as a CUDA graph."""

    def __init__(self, weights: FusedDecoder, rows: int, capacity: int, capture: bool) -> None:
        self.weights, self.model, self.rows, self.capacity = weights, weights.model, rows, capacity
        model = self.model
        self.heads, self.kv_heads, self.head_dim = weights.heads, weights.kv_heads, weights.head_dim
        half = self.head_dim // 2
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
        # rotate_half(x) * sin == flip(x's halves) * (sin with its first half negated)
        self.sign = torch.cat([-torch.ones(half), torch.ones(half)]).to(device, dtype)
        scale = [weights.scaling] * self.heads + [1.0] * self.kv_heads  # q's softmax scaling, k's none
        self.scale = torch.tensor(scale, dtype=dtype, device=device)[:, None]
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
        """The step in few kernels (each one launch): q/k/v and gate/up as one product each over
        `FusedDecoder`'s fused weights; q and k rotated together, with q's scaling folded into its
        cos/sin; the mask added as a bias made once per step; the residual adds inside the products."""
        w, body = self.weights, self.model.model
        rows, heads, kv_heads, dim = self.rows, self.heads, self.kv_heads, self.head_dim
        width, eps = body.embed_tokens.embedding_dim, w.eps
        hidden = body.embed_tokens(self.tokens).view(rows, width)
        cos, sin = body.rotary_emb(hidden, self.positions)  # [B, 1, D]
        cos, sin = cos * self.scale, sin * self.sign * self.scale  # [B, heads + kv_heads, D]
        bias = torch.zeros(self.attend.shape, dtype=cos.dtype, device=cos.device)
        bias = bias.masked_fill(~(self.attend & (self.span <= self.position)), float("-inf"))[:, None, None]
        rotated = heads + kv_heads
        for (norm_in, qkv_w, qkv_b, o_proj, norm_post, gate_up_w, down_w), keys, values in zip(
            w.layers, self.keys, self.values, strict=True
        ):
            x = F.rms_norm(hidden, (width,), norm_in, eps)
            qkv = F.linear(x, qkv_w, qkv_b)  # [B, (heads + 2 kv_heads) * D]
            qk = qkv[:, : rotated * dim].view(rows, rotated, dim)
            qk = torch.addcmul(qk * cos, qk.view(rows, rotated, 2, dim // 2).flip(-2).view(qk.shape), sin)
            keys.index_copy_(2, self.position, qk[:, heads:, None])
            values.index_copy_(2, self.position, qkv[:, rotated * dim :].view(rows, kv_heads, 1, dim))
            # Grouped-query attention for one query: the heads sharing a kv head form its rows.
            q = qk[:, :heads].view(rows, kv_heads, heads // kv_heads, dim)
            probs = (torch.matmul(q, keys.transpose(-1, -2)) + bias).softmax(-1)
            out = torch.matmul(probs, values).view(rows, heads * dim)
            hidden = torch.addmm(hidden, out, o_proj.weight.t())
            if o_proj.bias is not None:
                hidden = hidden + o_proj.bias
            gate, up = F.linear(F.rms_norm(hidden, (width,), norm_post, eps), gate_up_w).split(
                w.intermediate, -1
            )
            hidden = torch.addmm(hidden, F.silu(gate) * up, down_w.t())
        return self.model.lm_head(F.rms_norm(hidden, (width,), body.norm.weight, eps))
