"""The batched packed-row attention against one causal SDPA call per sequence (no Ray, no model)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engines.attention import segment_attention


def per_sequence_reference(query, key, value, edges: list[int]) -> torch.Tensor:
    """Causal attention of each sequence alone, written out with explicit GQA expansion: [1, N, H, D]."""
    repeats = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(repeats, dim=1), value.repeat_interleave(repeats, dim=1)
    pieces = [
        F.scaled_dot_product_attention(query[:, :, s:e], key[:, :, s:e], value[:, :, s:e], is_causal=True)
        for s, e in zip(edges[:-1], edges[1:], strict=True)
    ]
    return torch.cat(pieces, dim=2).transpose(1, 2)


@pytest.mark.parametrize("lengths", [[5], [1, 7, 3, 7, 2], [4, 4, 4]])
def test_batched_segments_equal_one_call_per_sequence(lengths):
    torch.manual_seed(0)
    edges = [0, *torch.tensor(lengths).cumsum(0).tolist()]
    tokens, heads, kv_heads, dim = edges[-1], 4, 2, 8
    q = torch.randn(1, heads, tokens, dim, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, kv_heads, tokens, dim, dtype=torch.float64, requires_grad=True)
    v = torch.randn(1, kv_heads, tokens, dim, dtype=torch.float64, requires_grad=True)
    module = torch.nn.Module().eval()
    out, _ = segment_attention(module, q, k, v, None, cu_seq_lens_q=torch.tensor(edges))
    ref = per_sequence_reference(q, k, v, edges)
    assert out.shape == (1, tokens, heads, dim)
    assert torch.allclose(out, ref, rtol=0, atol=1e-12)
    weights = torch.randn_like(ref)  # a loss that weighs every output differently
    grads = torch.autograd.grad((out * weights).sum(), (q, k, v))
    ref_grads = torch.autograd.grad((ref * weights).sum(), (q, k, v))
    for got, want in zip(grads, ref_grads, strict=True):
        assert torch.allclose(got, want, rtol=0, atol=1e-12)


def test_missing_boundaries_are_a_clear_error():
    x = torch.zeros(1, 2, 3, 4)
    with pytest.raises(ValueError, match="cu_seq_lens_q"):
        segment_attention(torch.nn.Module(), x, x, x, None)
