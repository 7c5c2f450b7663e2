"""The RMSNorm of engines/kernels/fused_layers.py against transformers' RMSNorm and an fp64 reference
written out by hand: outputs, input and weight gradients on the fused and the eager path, what it leaves
alone, and a whole model with and without it."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers.models.llama import modeling_llama
from transformers.models.qwen2 import modeling_qwen2

from engines.kernels import cpu_kernels, fused_layers
from tests.engine_util import assert_same_model_outputs, log_probs_and_grads, small_llama


def reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The norm in fp64, written as its definition (the gradient comes from autograd over it)."""
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * weight


@pytest.mark.parametrize("path", ["fused", "eager"])
@pytest.mark.parametrize("shape", [(1, 37, 64), (3, 5, 48), (7, 576), (1312, 576)])
def test_function_equals_the_definition_and_transformers(shape, path, monkeypatch):
    """The Function on both of its paths: the fused kernels (engines/kernels/cpu_kernels.c) and eager ops."""
    if path == "eager":
        monkeypatch.setattr(cpu_kernels, "kernels", lambda: None)
    elif cpu_kernels.kernels() is None:
        pytest.skip("the fused kernels do not build on this machine (no C compiler)")
    fused_calls = []
    backward = cpu_kernels.CpuKernels.rms_norm_backward
    monkeypatch.setattr(
        cpu_kernels.CpuKernels, "rms_norm_backward", lambda *a: fused_calls.append(1) or backward(*a)
    )
    g = torch.Generator().manual_seed(sum(shape))
    x = torch.randn(shape, generator=g) * 3
    weight = torch.randn(shape[-1], generator=g) * 0.2 + 1
    upstream = torch.randn(shape, generator=g)  # every output weighed apart
    eps = 1e-5

    def run(fn, dtype):
        xs = x.to(dtype).requires_grad_(True)
        w = weight.to(dtype).requires_grad_(True)
        y = fn(xs, w)
        (y * upstream.to(dtype)).sum().backward()
        return y.detach().double(), xs.grad.double(), w.grad.double()

    want = run(lambda a, b: reference(a, b, eps), torch.float64)
    got = run(lambda a, b: fused_layers.RMSNormFunction.apply(a, b, eps), torch.float32)
    norm = modeling_llama.LlamaRMSNorm(shape[-1], eps=eps)

    def transformers_norm(a, b):
        norm.weight = torch.nn.Parameter(b)
        return norm(a)

    theirs = run(transformers_norm, torch.float32)
    assert len(fused_calls) == (1 if path == "fused" else 0)
    for name, mine, exact, hf in zip(("y", "dx", "dw"), got, want, theirs, strict=True):
        scale = exact.abs().max()
        assert (mine - exact).abs().max() <= 2e-6 * scale, name  # fp32 against fp64
        assert (mine - exact).abs().max() <= 2 * (hf - exact).abs().max() + 1e-6 * scale, (
            name
        )  # as good as theirs


def test_install_routes_the_models_norms_and_nothing_else(monkeypatch):
    config = modeling_qwen2.Qwen2Config(
        vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2,
    )  # fmt: skip
    model = modeling_qwen2.Qwen2ForCausalLM(config)
    assert fused_layers.install_rms_norm(model) == 2 * 2 + 1  # two a layer and the final one
    assert fused_layers.install_rms_norm(model) == 0  # once
    norm = model.model.norm
    calls = []
    monkeypatch.setattr(fused_layers.RMSNormFunction, "apply", lambda *a: calls.append(a) or a[0])
    norm(torch.randn(2, 32))
    assert len(calls) == 1
    norm(torch.randn(2, 32, dtype=torch.float64))  # not fp32: the module's own forward
    with torch.autocast("cpu", dtype=torch.bfloat16):
        norm(torch.randn(2, 32))
    assert len(calls) == 1
    # a copy of the model runs its own weights, not the original's
    twin = copy.deepcopy(model)
    monkeypatch.undo()
    with torch.no_grad():
        twin.model.norm.weight.mul_(2)
        x = torch.randn(3, 32)
        assert torch.allclose(twin.model.norm(x), 2 * norm(x))
    other = modeling_llama.LlamaForCausalLM(modeling_llama.LlamaConfig(
        vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=4,
    ))  # fmt: skip
    before = {name: type(m) for name, m in other.named_modules()}
    assert fused_layers.install_rms_norm(other.model.layers[0].mlp) == 0  # no norm in it
    assert {name: type(m) for name, m in other.named_modules()} == before


def test_a_model_gives_the_same_log_probs_and_gradients():
    """A small Llama in fp32: token log-probs and every parameter's gradient with the Function equal
    those with transformers' norm (largest difference measured: 2.3e-7 of a gradient's largest entry)."""
    plain = small_llama()
    for param in plain.parameters():  # norms away from 1, so that their weights matter
        if param.dim() == 1:
            param.data.uniform_(0.5, 1.5)
    fused = copy.deepcopy(plain)
    assert fused_layers.install_rms_norm(fused) == 9
    assert_same_model_outputs(log_probs_and_grads(fused), log_probs_and_grads(plain))
