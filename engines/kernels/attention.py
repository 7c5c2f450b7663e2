"""Attention over a packed row without a dense N x N mask: one batched causal SDPA call per layer.

Registered with transformers as "tandem_segments": the packed q/k/v are scattered into a right-padded
[sequences, heads, longest, dim] grid (right padding keeps causal attention exact), one SDPA call
runs, and the real tokens are gathered back; boundaries arrive as `cu_seq_lens_q`. With a
`shared_prompt` layout (engines/kernels/shared_prompt.py) each group's prompt is attended once.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from engines.kernels import shared_attention
from engines.kernels.shared_prompt import AttentionLayout, SharedPromptPack

NAME = "tandem_segments"
_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def padded_index(edges: list[int], device: torch.device) -> tuple[torch.Tensor, int]:
    """(index [N] of each packed token in the flattened [S * longest] padded grid, longest)."""
    lengths = torch.tensor([e - s for s, e in zip(edges[:-1], edges[1:], strict=True)])
    longest = int(lengths.max())
    seq = torch.repeat_interleave(torch.arange(len(lengths)), lengths)
    starts = torch.tensor(edges[:-1])
    index = seq * longest + torch.arange(edges[-1] - edges[0]) - (starts[seq] - edges[0])
    return index.to(device), longest


def segment_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """query [1, H, N, D], key/value [1, Hkv, N, D] → output [1, N, H, D]."""
    if query.device.type == "cpu" and torch.is_autocast_enabled("cpu"):
        # The CPU's bf16 SDPA kernel is slower than fp32 with the upcasts.
        with torch.autocast("cpu", enabled=False):
            q, k, v = query.float(), key.float(), value.float()
            return segment_attention(module, q, k, v, attention_mask, dropout, scaling, **kwargs)
    shared = kwargs.get("shared_prompt")
    if shared is not None:
        return _shared_prompt_attention(module, query, key, value, shared, dropout, scaling), None
    bounds = kwargs.get("cu_seq_lens_q")
    if bounds is None:
        raise ValueError(f"attention '{NAME}' needs cu_seq_lens_q (the packed sequence boundaries)")
    edges = bounds.tolist() if isinstance(bounds, torch.Tensor) else list(bounds)
    index, longest = padded_index(edges, query.device)
    sequences = len(edges) - 1

    def to_padded(x: torch.Tensor) -> torch.Tensor:  # [1, h, N, D] -> [S, h, longest, D]
        tokens = x[0].transpose(0, 1)  # [N, h, D]
        grid = tokens.new_zeros(sequences * longest, *tokens.shape[1:]).index_copy_(0, index, tokens)
        return grid.view(sequences, longest, *tokens.shape[1:]).transpose(1, 2)

    q, k, v = to_padded(query), to_padded(key), to_padded(value)
    p = dropout if module.training else 0.0
    # Not cuDNN: it builds and caches a plan per shape, and RL lengths rarely repeat.
    with sdpa_kernel(_BACKENDS):
        out = F.scaled_dot_product_attention(
            q, k, v, dropout_p=p, is_causal=True, scale=scaling, enable_gqa=k.shape[1] != q.shape[1]
        )
    out = out.transpose(1, 2).reshape(sequences * longest, *out.shape[1::2])  # [S * longest, H, D]
    return out.index_select(0, index)[None], None


def _shared_prompt_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    layout: SharedPromptPack,
    dropout: float,
    scaling: float | None,
) -> torch.Tensor:
    """The prompts causal in a [G, P] grid, each response's queries over [its group's prompt keys ; its
    own keys] in an [S, R] grid."""
    grids = layout.attention
    p = dropout if module.training else 0.0
    if shared_attention.fits(query, grids, p):
        scale = query.shape[-1] ** -0.5 if scaling is None else scaling
        return shared_attention.attend(query, key, value, grids, scale)
    g, p_len, r_len = grids.groups, grids.prompt_len, grids.response_len
    responses = grids.response_group.shape[0]

    def to_grids(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[1, h, N, D] -> the prompts [G, h, P, D] and the responses [S, h, R, D]."""
        tokens = x[0].transpose(0, 1)  # [N, h, D]
        # In place: the out-of-place index_copy copies the whole zero grid first.
        cells = tokens.new_zeros(g * p_len + responses * r_len, *tokens.shape[1:])
        cells.index_copy_(0, grids.slot, tokens)
        prompts, answers = cells[: g * p_len], cells[g * p_len :]
        return (prompts.view(g, p_len, *tokens.shape[1:]).transpose(1, 2),
                answers.view(responses, r_len, *tokens.shape[1:]).transpose(1, 2))  # fmt: skip

    (qp, qr), (kp, kr), (vp, vr) = to_grids(query), to_grids(key), to_grids(value)
    gqa = key.shape[1] != query.shape[1]
    with sdpa_kernel(_BACKENDS):
        out_prompt = F.scaled_dot_product_attention(
            qp, kp, vp, dropout_p=p, is_causal=True, scale=scaling, enable_gqa=gqa
        )
        outs = [out_prompt.transpose(1, 2).reshape(g * p_len, *out_prompt.shape[1::2])]
        if responses:
            k = torch.cat([_per_response(kp, grids), kr], dim=2)
            v = torch.cat([_per_response(vp, grids), vr], dim=2)
            out = F.scaled_dot_product_attention(
                qr, k, v, attn_mask=grids.response_mask, dropout_p=p, scale=scaling, enable_gqa=gqa
            )
            outs.append(out.transpose(1, 2).reshape(responses * r_len, *out.shape[1::2]))
    return _TakeRows.apply(torch.cat(outs), grids.slot)[None]


def _per_response(prompt: torch.Tensor, grids: AttentionLayout) -> torch.Tensor:
    """[G, h, P, D] -> [S, h, P, D], each response's group's row (an expand when groups are equal)."""
    if grids.responses_per_group:
        n = grids.responses_per_group
        return prompt[:, None].expand(-1, n, *prompt.shape[1:]).flatten(0, 1)
    return prompt.index_select(0, grids.response_group)


class _TakeRows(torch.autograd.Function):
    """x.index_select(0, index) for an index without repeats, whose backward copies rows back instead of
    index_select's scatter-add (slower on CPU)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(index)
        ctx.rows = x.shape[0]
        return x.index_select(0, index)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        (index,) = ctx.saved_tensors
        return grad.new_zeros(ctx.rows, *grad.shape[1:]).index_copy_(0, index, grad), None


def register() -> str:
    """Make NAME a valid `attn_implementation` for transformers models; returns NAME."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask

    AttentionInterface.register(NAME, segment_attention)
    # Like flash-attention, it needs no mask tensor: the boundaries say everything.
    AttentionMaskInterface.register(NAME, flash_attention_mask)
    return NAME
