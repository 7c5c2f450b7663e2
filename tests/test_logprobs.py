"""The chunked log-prob/entropy Function against the plain full-vocabulary computation, on both of its
CPU paths: the fused kernels of engines/kernels/cpu_kernels.c and eager ops."""

from __future__ import annotations

import pytest
import torch

from engines.kernels import cpu_kernels, logprobs
from engines.kernels.logprobs import token_log_probs


@pytest.fixture(params=["fused", "eager"])
def path(request, monkeypatch):
    """Run the test on one path; yields a list that counts the fused kernel calls."""
    calls: list[str] = []
    if request.param == "eager":
        monkeypatch.setenv("TANDEM_CPU_KERNELS", "0")
    elif cpu_kernels.kernels() is None:
        pytest.skip("the fused kernels do not build on this machine (no C compiler)")
    for name in ("log_softmax_stats", "log_softmax_grad"):
        original = getattr(cpu_kernels.CpuKernels, name)
        monkeypatch.setattr(
            cpu_kernels.CpuKernels,
            name,
            lambda self, *a, _n=name, _f=original: calls.append(_n) or _f(self, *a),
        )
    return request.param, calls


def plain(hidden, weight, targets, temperature):
    """The reference: full [N, V] logits, log-softmax, gather, entropy, with autograd's own backward."""
    log_p = torch.log_softmax(hidden @ weight.T / temperature, dim=-1)
    return log_p.gather(-1, targets[:, None]).squeeze(-1), -(log_p.exp() * log_p).sum(-1)


def inputs(n: int, vocab: int, width: int, dtype=torch.float32, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, width, generator=g, dtype=dtype).requires_grad_(True)
    weight = (torch.randn(vocab, width, generator=g, dtype=dtype) * 0.5).requires_grad_(True)
    targets = torch.randint(0, vocab, (n,), generator=g)
    return (
        hidden,
        weight,
        targets,
        torch.randn(n, generator=g, dtype=dtype),
        torch.randn(n, generator=g, dtype=dtype),
    )


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("entropy_in_loss", [True, False])
@pytest.mark.parametrize("keep", [False, True], ids=["recompute", "keep"])
def test_values_and_gradients_match_the_plain_computation(
    temperature, entropy_in_loss, keep, monkeypatch, path
):
    # element-wise passes in blocks of 3 rows: chunks of 8 rows run as blocks of 3, 3 and 2
    monkeypatch.setattr(logprobs, "BLOCK_ELEMENTS", 3 * 301)
    hidden, weight, targets, a, b = inputs(n=37, vocab=301, width=24)
    # chunk 8 does not divide 37: the last chunk is short; keep: the forward's log-softmax (44 KB) is
    # kept for the backward instead of recomputed
    keep_bytes = 37 * 301 * 4 if keep else 37 * 301 * 4 - 1
    lp, ent = token_log_probs(hidden, weight, targets, temperature, True, 8, keep_bytes)
    loss = (a * lp).sum() + ((b * ent).sum() if entropy_in_loss else 0)
    grads = torch.autograd.grad(loss, (hidden, weight))
    ref_lp, ref_ent = plain(hidden, weight, targets, temperature)
    ref_loss = (a * ref_lp).sum() + ((b * ref_ent).sum() if entropy_in_loss else 0)
    ref_grads = torch.autograd.grad(ref_loss, (hidden, weight))
    torch.testing.assert_close(lp, ref_lp, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ent, ref_ent, atol=1e-5, rtol=1e-5)
    for got, want in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    name, calls = path
    chunks = 5  # 37 rows in chunks of 8: one forward and one backward call a chunk when fused
    want_calls = ["log_softmax_stats"] * chunks + ["log_softmax_grad"] * chunks if name == "fused" else []
    assert calls == want_calls


@pytest.mark.parametrize("scale", [1.0, 40.0])
def test_large_logits_against_float64(scale, path):
    """Logits of magnitude up to ~1000 (a max subtraction missed would overflow exp) and a vocabulary
    of 49k, the size of SmolLM2's, against the plain computation in fp64."""
    hidden, weight, targets, a, b = inputs(n=20, vocab=49152, width=16, seed=7)
    hidden = (hidden.detach() * scale).requires_grad_(True)
    lp, ent = token_log_probs(hidden, weight, targets, 1.0, True, 8)
    grads = torch.autograd.grad((a * lp).sum() + (b * ent).sum(), (hidden, weight))
    wide = [t.detach().double().requires_grad_(True) for t in (hidden, weight)]
    ref_lp, ref_ent = plain(*wide, targets, 1.0)
    ref_grads = torch.autograd.grad((a.double() * ref_lp).sum() + (b.double() * ref_ent).sum(), wide)
    assert torch.isfinite(lp).all() and torch.isfinite(ent).all()
    torch.testing.assert_close(lp.double(), ref_lp, atol=2e-4 * scale, rtol=1e-5)
    torch.testing.assert_close(ent.double(), ref_ent, atol=2e-4 * scale, rtol=1e-5)
    for got, want in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(got.double(), want, atol=2e-4 * scale, rtol=1e-4)
    assert bool(path[1]) == (path[0] == "fused")


def test_a_target_outside_the_vocabulary_is_an_error(path):
    """On both paths an id past the vocabulary raises (the fused kernels index rows by it)."""
    hidden, weight, targets, _, _ = inputs(n=6, vocab=30, width=8, seed=5)
    targets[3] = 30
    with pytest.raises((IndexError, RuntimeError), match="index|target"):
        token_log_probs(hidden, weight, targets, 1.0, True, 4)


def test_without_entropy_and_a_frozen_weight(path):
    hidden, weight, targets, a, _ = inputs(n=20, vocab=97, width=16, seed=1)
    weight = weight.detach()  # a frozen output projection (LoRA leaves it out)
    lp, ent = token_log_probs(hidden, weight, targets, 1.0, with_entropy=False, chunk_tokens=6)
    assert ent is None
    (grad,) = torch.autograd.grad((a * lp).sum(), hidden)
    ref_lp, _ = plain(hidden, weight, targets, 1.0)
    (ref_grad,) = torch.autograd.grad((a * ref_lp).sum(), hidden)
    torch.testing.assert_close(lp, ref_lp, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(grad, ref_grad, atol=1e-5, rtol=1e-5)


def test_gradcheck_in_float64():
    hidden, weight, targets, _, _ = inputs(n=7, vocab=11, width=5, dtype=torch.float64, seed=2)

    def f(h, w):
        return token_log_probs(h, w, targets, 0.9, with_entropy=True, chunk_tokens=3)

    assert torch.autograd.gradcheck(f, (hidden, weight))


def test_no_grad_forward_keeps_nothing():
    hidden, weight, targets, _, _ = inputs(n=9, vocab=50, width=8, seed=3)
    with torch.no_grad():
        lp, ent = token_log_probs(hidden, weight, targets, 1.0, with_entropy=True, chunk_tokens=4)
    assert lp.grad_fn is None and ent.grad_fn is None
    ref_lp, ref_ent = plain(hidden.detach(), weight.detach(), targets, 1.0)
    torch.testing.assert_close(lp, ref_lp, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ent, ref_ent, atol=1e-5, rtol=1e-5)


def test_kept_log_softmax_is_used_once_and_a_second_backward_recomputes():
    hidden, weight, targets, a, _ = inputs(n=12, vocab=40, width=8, seed=4)
    lp, _ = token_log_probs(hidden, weight, targets, 1.0, False, 5, keep_bytes=1 << 20)
    first = torch.autograd.grad((a * lp).sum(), (hidden, weight), retain_graph=True)
    second = torch.autograd.grad((a * lp).sum(), (hidden, weight))  # the kept tensors are spent
    ref_lp, _ = plain(hidden, weight, targets, 1.0)
    ref = torch.autograd.grad((a * ref_lp).sum(), (hidden, weight))
    for got_first, got_second, want in zip(first, second, ref, strict=True):
        torch.testing.assert_close(got_first, want, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got_second, want, atol=1e-5, rtol=1e-5)
