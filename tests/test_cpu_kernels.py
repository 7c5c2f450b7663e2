"""engines/kernels/cpu_kernels.py and the SwiGLU of engines/kernels/fused_layers.py: the fused SwiGLU
against an fp64 reference and the eager expression, a model with the fused MLPs against one without,
what loading the library leaves alone (denormals), and a failed build falling back to eager PyTorch."""

from __future__ import annotations

import copy
import logging
import shutil

import pytest
import torch
from transformers.models.llama import modeling_llama
from transformers.models.qwen2 import modeling_qwen2

from engines.kernels import cpu_kernels, fused_layers
from tests.engine_util import assert_same_model_outputs, log_probs_and_grads, small_llama

needs_compiler = pytest.mark.skipif(
    shutil.which("cc") is None and shutil.which("gcc") is None, reason="no C compiler on this machine"
)


@needs_compiler
def test_the_kernels_build_where_a_compiler_is():
    assert cpu_kernels.kernels() is not None


@needs_compiler
@pytest.mark.parametrize("shape", [(1, 37, 128), (3, 5, 48), (2048, 1536)])
def test_swiglu_equals_the_definition(shape):
    """Forward and both gradients in fp32 against fp64 autograd over silu(g) * u, with gates far
    into both tails (sigmoid under- and overflowing in exp) and an upstream gradient per entry."""
    g = torch.Generator().manual_seed(sum(shape))
    gate = torch.randn(shape, generator=g) * 4
    gate.view(-1)[:4] = torch.tensor([-100.0, -30.0, 30.0, 100.0])
    up = torch.randn(shape, generator=g)
    upstream = torch.randn(shape, generator=g)

    def run(fn, dtype):
        a = gate.to(dtype).requires_grad_(True)
        b = up.to(dtype).requires_grad_(True)
        y = fn(a, b)
        (y * upstream.to(dtype)).sum().backward()
        return y, a.grad.double(), b.grad.double()

    want = run(lambda a, b: a * torch.sigmoid(a) * b, torch.float64)
    got = run(lambda a, b: fused_layers.swiglu(a, b, torch.nn.functional.silu), torch.float32)
    assert type(got[0].grad_fn).__name__ == "SwiGLUFunctionBackward"  # the fused path ran
    eager = run(lambda a, b: torch.nn.functional.silu(a) * b, torch.float32)
    for name, mine, exact, theirs in zip(("y", "d gate", "d up"), got, want, eager, strict=True):
        mine, exact, theirs = mine.detach().double(), exact.detach(), theirs.detach().double()
        scale = exact.abs().max()
        assert torch.isfinite(mine).all(), name
        assert (mine - exact).abs().max() <= 2e-6 * scale, name  # fp32 against fp64
        assert (mine - exact).abs().max() <= 2 * (theirs - exact).abs().max() + 1e-6 * scale, name


@needs_compiler
def test_what_the_fused_path_leaves_to_eager():
    fused = []
    real = fused_layers.SwiGLUFunction.apply

    def spy(*args):
        fused.append(args)
        return real(*args)

    fused_layers.SwiGLUFunction.apply = spy
    try:
        act = torch.nn.functional.silu
        fused_layers.swiglu(torch.randn(4, 8), torch.randn(4, 8), act)
        assert len(fused) == 1
        fused_layers.swiglu(
            torch.randn(4, 8, dtype=torch.float64), torch.randn(4, 8, dtype=torch.float64), act
        )
        fused_layers.swiglu(torch.randn(8, 4).t(), torch.randn(4, 8), act)  # not contiguous
        with torch.autocast("cpu", dtype=torch.bfloat16):
            fused_layers.swiglu(torch.randn(4, 8), torch.randn(4, 8), act)
        assert len(fused) == 1
    finally:
        fused_layers.SwiGLUFunction.apply = real


@needs_compiler
def test_a_model_with_the_fused_mlps_gives_the_same_log_probs_and_gradients():
    plain = small_llama()
    fused = copy.deepcopy(plain)
    assert fused_layers.install_swiglu(fused) == 4
    assert fused_layers.install_swiglu(fused) == 0  # once
    assert_same_model_outputs(log_probs_and_grads(fused), log_probs_and_grads(plain))


def test_install_takes_silu_mlps_only():
    def qwen2(act: str):
        return modeling_qwen2.Qwen2ForCausalLM(modeling_qwen2.Qwen2Config(
            vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, hidden_act=act,
        ))  # fmt: skip

    assert fused_layers.install_swiglu(qwen2("silu")) == 2
    assert fused_layers.install_swiglu(qwen2("gelu")) == 0  # another activation: the module's own forward
    llama = modeling_llama.LlamaForCausalLM(modeling_llama.LlamaConfig(
        vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=4,
    ))  # fmt: skip
    assert fused_layers.install_swiglu(llama.model.layers[0].self_attn) == 0  # no MLP in it


@needs_compiler
def test_loading_the_library_keeps_denormals():
    """Compiled with -ffast-math, linked without it: the process does not flush denormals to zero."""
    assert cpu_kernels.kernels() is not None
    tiny = torch.tensor([1e-40], dtype=torch.float32)
    assert (tiny * 1.0).item() != 0.0
    assert (tiny + 0.0).item() > 0.0


def test_a_failed_build_falls_back_and_says_why(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("TANDEM_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    with caplog.at_level(logging.WARNING, logger="engines.kernels.cpu_kernels"):
        assert cpu_kernels._build_and_load() is None
    assert "did not build" in caplog.text and "no-such-compiler" in caplog.text
    monkeypatch.setenv("TANDEM_CPU_KERNELS", "0")
    assert cpu_kernels.kernels() is None
    # and the model's MLP then runs the eager expression
    gate = torch.randn(3, 8, requires_grad=True)
    out = fused_layers.swiglu(gate, torch.randn(3, 8), torch.nn.functional.silu)
    assert type(out.grad_fn).__name__ == "MulBackward0"


@needs_compiler
def test_a_build_lands_in_its_cache_once(monkeypatch, tmp_path):
    monkeypatch.setenv("TANDEM_KERNEL_CACHE", str(tmp_path))
    first = cpu_kernels._build_and_load()
    assert first is not None and first.path.parent == tmp_path
    stamp = first.path.stat().st_mtime_ns
    second = cpu_kernels._build_and_load()
    assert second.path == first.path and second.path.stat().st_mtime_ns == stamp  # not rebuilt
    assert [p.name for p in tmp_path.iterdir()] == [first.path.name]  # no temporary left
