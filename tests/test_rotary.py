"""The rotary embedding of engines/kernels/fused_layers.py against transformers' own rotary embedding:
outputs, gradients, layouts, and a whole model's log-probs and gradients with one and the other (no
Ray)."""

from __future__ import annotations

import types

import pytest
import torch
from transformers.models.llama import modeling_llama
from transformers.models.qwen2 import modeling_qwen2

from engines.kernels import cpu_kernels, fused_layers
from tests.engine_util import assert_same_model_outputs, log_probs_and_grads, small_llama

# transformers' function, whatever an engine built earlier in this process installed
ORIGINAL = getattr(
    modeling_llama.apply_rotary_pos_emb, fused_layers.ROTARY_MARK, modeling_llama.apply_rotary_pos_emb
)


def cos_sin(tokens: int, dim: int, dtype=torch.float64) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / (10000 ** (torch.arange(0, dim, 2, dtype=dtype) / dim))
    freqs = torch.outer(torch.arange(tokens, dtype=dtype) * 1.3, inv)
    emb = torch.cat([freqs, freqs], -1)[None]  # [1, tokens, dim], as the models' rotary modules give
    return emb.cos(), emb.sin()


def projected(tokens: int, heads: int, dim: int, generator, dtype=torch.float64):
    """q as the attention layers make it: a [1, heads, tokens, dim] view of a [1, tokens, heads * dim]
    projection (not contiguous), with the projection as the leaf that gets the gradient."""
    flat = torch.randn(1, tokens, heads * dim, generator=generator, dtype=dtype).requires_grad_(True)
    return flat, flat.view(1, tokens, heads, dim).transpose(1, 2)


@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(9, 3, 64), (4, 4, 8), (2, 1, 6)])
def test_equals_transformers_forward_and_backward(heads, kv_heads, dim):
    g = torch.Generator().manual_seed(heads * 100 + dim)
    tokens = 37
    cos, sin = cos_sin(tokens, dim)
    results = []
    for fn in (ORIGINAL, fused_layers.fused_rotary(ORIGINAL)):
        g.manual_seed(1)
        q_leaf, q = projected(tokens, heads, dim, g)
        k_leaf, k = projected(tokens, kv_heads, dim, g)
        out_q, out_k = fn(q, k, cos, sin)
        weights_q = torch.randn(out_q.shape, generator=g, dtype=out_q.dtype)  # every output weighed apart
        weights_k = torch.randn(out_k.shape, generator=g, dtype=out_k.dtype)
        ((out_q * weights_q).sum() + (out_k * weights_k).sum()).backward()
        results.append((out_q, out_k, q_leaf.grad, k_leaf.grad))
    (want_q, want_k, want_dq, want_dk), (got_q, got_k, got_dq, got_dk) = results
    for got, want in ((got_q, want_q), (got_k, want_k), (got_dq, want_dq), (got_dk, want_dk)):
        assert got.shape == want.shape and got.dtype == want.dtype
        assert torch.allclose(got, want, rtol=0, atol=1e-12), (got - want).abs().max()
    # laid out as the projection was (what the attention function reads next), not re-packed
    assert got_q.stride() == q.stride() and got_k.stride() == k.stride()


@pytest.mark.parametrize("path", ["fused", "eager"])
@pytest.mark.parametrize("unsqueeze_dim", [1, 2])
def test_fp32_on_both_paths_against_float64(path, unsqueeze_dim, monkeypatch):
    """fp32 q, k (the kernel of engines/kernels/cpu_kernels.c, or the Function's eager calls) against
    transformers' function in fp64: outputs and the gradients of q and k, both head layouts, with
    SmolLM2's heads and a gradient whose rows are strided (a transposed view), as autograd hands them."""
    if path == "eager":
        monkeypatch.setenv("TANDEM_CPU_KERNELS", "0")
    elif cpu_kernels.kernels() is None:
        pytest.skip("the fused kernels do not build on this machine (no C compiler)")
    calls = []
    original_kernel = cpu_kernels.CpuKernels.rotary
    monkeypatch.setattr(
        cpu_kernels.CpuKernels, "rotary", lambda *a: calls.append(a[-1]) or original_kernel(*a)
    )
    tokens, dim = 29, 64
    cos, sin = cos_sin(tokens, dim)
    g = torch.Generator().manual_seed(unsqueeze_dim)
    results = []
    for fn, dtype in ((ORIGINAL, torch.float64), (fused_layers.fused_rotary(ORIGINAL), torch.float32)):
        g.manual_seed(5)
        q_leaf, q = projected(tokens, 9, dim, g)
        k_leaf, k = projected(tokens, 3, dim, g)
        if unsqueeze_dim == 2:  # [1, tokens, heads, dim]
            q, k = q.transpose(1, 2), k.transpose(1, 2)
        q, k = q.to(dtype), k.to(dtype)
        out_q, out_k = fn(q, k, cos.to(dtype), sin.to(dtype), unsqueeze_dim=unsqueeze_dim)
        swapped = (out_q.shape[0], out_q.shape[2], out_q.shape[1], out_q.shape[3])
        upstream_q = torch.randn(swapped, generator=g, dtype=torch.float64).transpose(1, 2)
        upstream_k = torch.randn(out_k.shape, generator=g, dtype=torch.float64)
        torch.autograd.backward((out_q, out_k), (upstream_q.to(dtype), upstream_k.to(dtype)))
        results.append([t.double() for t in (out_q, out_k, q_leaf.grad, k_leaf.grad)])
    for want, got in zip(*results, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=2e-6)
    assert calls == ([False, False, True, True] if path == "fused" else [])


def test_heads_last_layout():
    """unsqueeze_dim=2: q as [1, tokens, heads, dim] with cos/sin [1, tokens, dim]."""
    g = torch.Generator().manual_seed(3)
    cos, sin = cos_sin(11, 16)
    q = torch.randn(1, 11, 4, 16, generator=g, dtype=torch.float64)
    k = torch.randn(1, 11, 2, 16, generator=g, dtype=torch.float64)
    want = ORIGINAL(q, k, cos, sin, unsqueeze_dim=2)
    got = fused_layers.fused_rotary(ORIGINAL)(q, k, cos, sin, unsqueeze_dim=2)
    for a, b in zip(got, want, strict=True):
        assert torch.allclose(a, b, rtol=0, atol=1e-12)


def test_what_does_not_fit_goes_to_the_original():
    """bf16 q with fp32 cos (CPU autocast): transformers' products promote to fp32, and so must the
    result; cos needing a gradient: the Function gives it none, so the original runs."""
    g = torch.Generator().manual_seed(4)
    cos, sin = cos_sin(5, 8, torch.float32)
    q = torch.randn(1, 2, 5, 8, generator=g).to(torch.bfloat16)
    k = torch.randn(1, 1, 5, 8, generator=g).to(torch.bfloat16)
    got = fused_layers.fused_rotary(ORIGINAL)(q, k, cos, sin)
    assert got[0].dtype == torch.float32
    assert torch.equal(got[0], ORIGINAL(q, k, cos, sin)[0])

    calls = []

    def spy(*args):
        calls.append(args)
        return ORIGINAL(*args)

    cos_leaf = cos.clone().requires_grad_(True)
    fused_layers.fused_rotary(spy)(q.float(), k.float(), cos_leaf, sin)
    assert len(calls) == 1
    fused_layers.fused_rotary(spy)(q.float(), k.float(), cos, sin)
    assert len(calls) == 1  # this one fits: the Function ran


def test_install_changes_standard_modules_only(monkeypatch):
    original = getattr(
        modeling_qwen2.apply_rotary_pos_emb, fused_layers.ROTARY_MARK, modeling_qwen2.apply_rotary_pos_emb
    )
    monkeypatch.setattr(modeling_qwen2, "apply_rotary_pos_emb", original)
    assert fused_layers.install_rotary(modeling_qwen2)
    installed = modeling_qwen2.apply_rotary_pos_emb
    assert getattr(installed, fused_layers.ROTARY_MARK) is original
    assert (
        fused_layers.install_rotary(modeling_qwen2) and modeling_qwen2.apply_rotary_pos_emb is installed
    )  # once

    def partial_rotary(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):  # another contract
        return q, k

    other = types.ModuleType("other_modeling")
    other.apply_rotary_pos_emb = partial_rotary
    assert not fused_layers.install_rotary(other) and other.apply_rotary_pos_emb is partial_rotary
    assert not fused_layers.install_rotary(types.ModuleType("no_rotary"))


def test_a_model_gives_the_same_log_probs_and_gradients(monkeypatch):
    """A small Llama (GQA, 4 layers) in fp32: token log-probs and every parameter's gradient with the
    Function equal those with transformers' function."""
    model = small_llama()
    results = []
    for fn in (fused_layers.fused_rotary(ORIGINAL), ORIGINAL):
        monkeypatch.setattr(modeling_llama, "apply_rotary_pos_emb", fn)
        results.append(log_probs_and_grads(model))
    assert_same_model_outputs(*results)
