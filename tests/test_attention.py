"""The batched packed-row attention against one causal SDPA call per sequence (no Ray, no model)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engines.kernels import shared_attention
from engines.kernels.attention import segment_attention
from engines.kernels.shared_prompt import pack_shared, prompt_groups


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


@pytest.mark.parametrize("path", ["products", "sdpa"])
@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 2), (3, 3)])
@pytest.mark.parametrize(
    ("row_group", "response_lens"),
    [
        ([0, 1, 0, 1, 2, 1], [4, 1, 2, 5, 3, 2]),
        ([0, 1, 0, 1, 2, 1], [2, 0, 4, 1, 3, 2]),
        ([0, 1, 2, 0, 1, 2], [3, 3, 1, 2, 3, 4]),  # as many responses per group: the expand path
    ],
)
def test_shared_prompt_attention_equals_each_row_alone(
    row_group, response_lens, heads, kv_heads, path, monkeypatch
):
    """Groups of different prompt lengths and sizes (rows interleaved; a row may have no response):
    every packed token's output and the q/k/v gradients equal those of each row's own causal
    attention over [its prompt copy ; its response], the copies' gradients summed back. Both ways
    of computing it: engines/kernels/shared_attention.py's products (short rows on a CPU) and SDPA (rows
    longer than MAX_KEYS, set to 0 here to take that path)."""
    if path == "sdpa":
        monkeypatch.setattr(shared_attention, "MAX_KEYS", 0)
    prompts = {0: 3, 1: 5, 2: 1}  # group -> prompt length
    width = max(response_lens)
    g = torch.Generator().manual_seed(1)
    prompt_ids = {grp: torch.randint(4, 99, (n,), generator=g) for grp, n in prompts.items()}
    ids = torch.zeros(len(row_group), 5 + width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, (grp, length) in enumerate(zip(row_group, response_lens, strict=True)):
        ids[row, 5 - prompts[grp] : 5] = prompt_ids[grp]
        ids[row, 5 : 5 + length] = torch.randint(4, 99, (length,), generator=g)
        mask[row, 5 - prompts[grp] : 5 + length] = 1
    groups = prompt_groups(ids, mask, width)
    pack = pack_shared(ids, mask, width, groups)
    # The packed order (engines/kernels/shared_prompt.py): per group, its prompt, then its rows' responses.
    sequences: list[list[int]] = []  # each row's packed positions: [prompt ; response]
    cursor = 0
    for rows in groups:
        prompt = list(range(cursor, cursor + prompts[row_group[rows[0]]]))
        cursor += len(prompt)
        for row in rows:
            sequences.append(prompt + list(range(cursor, cursor + response_lens[row])))
            cursor += response_lens[row]
    assert cursor == pack.input_ids.shape[1]
    dim = 8
    q = torch.randn(1, heads, cursor, dim, dtype=torch.float64, generator=g, requires_grad=True)
    k = torch.randn(1, kv_heads, cursor, dim, dtype=torch.float64, generator=g, requires_grad=True)
    v = torch.randn(1, kv_heads, cursor, dim, dtype=torch.float64, generator=g, requires_grad=True)
    out, _ = segment_attention(torch.nn.Module().eval(), q, k, v, None, shared_prompt=pack)
    ran_products = type(out.grad_fn).__name__ == "SharedPromptProductsBackward"
    assert ran_products == (path == "products")
    flat = torch.tensor([i for seq in sequences for i in seq])
    edges = [0, *torch.tensor([len(seq) for seq in sequences]).cumsum(0).tolist()]
    ref_rows = per_sequence_reference(q[:, :, flat], k[:, :, flat], v[:, :, flat], edges)[0]
    # Each packed token's reference output: its first occurrence in the unshared rows.
    first = {}
    for unshared, packed in enumerate(flat.tolist()):
        first.setdefault(packed, unshared)
    ref = ref_rows[[first[i] for i in range(cursor)]][None]
    assert out.shape == ref.shape == (1, cursor, heads, dim)
    assert torch.allclose(out, ref, rtol=0, atol=1e-12)
    weights = torch.randn(ref.shape, dtype=torch.float64, generator=g)
    grads = torch.autograd.grad((out * weights).sum(), (q, k, v))
    ref_grads = torch.autograd.grad((ref * weights).sum(), (q, k, v))
    for got, want in zip(grads, ref_grads, strict=True):
        assert torch.allclose(got, want, rtol=0, atol=1e-12)
