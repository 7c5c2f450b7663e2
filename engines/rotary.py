"""Rotary position embedding as one autograd Function on the CPU.

transformers applies rotary embedding as `q * cos + rotate_half(q) * sin`: a slice, a negation, a
concatenation, two products and a sum for each of q and k, every one a fresh tensor, and as many
again in the backward. With halves x1, x2 of the head dimension the same map is

    y1 = x1 * cos1 - x2 * sin1,        y2 = x2 * cos2 + x1 * sin2,

and its gradient, the rotation run backwards,

    dx1 = dy1 * cos1 + dy2 * sin2,     dx2 = dy2 * cos2 - dy1 * sin1,

four in-place element-wise calls a tensor each way, written into one output laid out as q is (the
projections' [tokens, heads, dim] order). In fp32 on a CPU the fused kernel of engines/cpu_kernels.c does each
rotation in one pass over x instead. cos and sin get no gradient (they come from the model's rotary buffers).

`install(module)` puts `apply_rotary_pos_emb` of a transformers modeling module (Llama's, Qwen2's:
the standard signature) through it. Anything else (a GPU tensor, q in another dtype than cos, as
under bf16 autocast, where transformers' products promote to fp32; cos or sin that need a gradient)
goes to the module's own function unchanged.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from types import ModuleType

import torch

from engines import cpu_kernels

STANDARD_PARAMETERS = ("q", "k", "cos", "sin", "unsqueeze_dim")
MARK = "_tandem_rotary_original"


def _halves(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    half = x.shape[-1] // 2
    return x[..., :half], x[..., half:]


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool) -> torch.Tensor:
    """y = R x (or R^T x with `inverse`) for cos/sin broadcastable to x; y has x's strides (where x
    is dense). One pass of the fused CPU kernel where it takes the tensors, else four eager calls."""
    fused = cpu_kernels.kernels() if cpu_kernels.rotary_fits(x, cos, sin) else None
    if fused is not None:
        return fused.rotary(x, cos, sin, inverse)
    out = torch.empty_like(x)
    (x1, x2), (y1, y2) = _halves(x), _halves(out)
    (c1, c2), (s1, s2) = _halves(cos), _halves(sin)
    if inverse:
        torch.mul(x1, c1, out=y1).addcmul_(x2, s2)
        torch.mul(x2, c2, out=y2).addcmul_(x1, s1, value=-1)
    else:
        torch.mul(x1, c1, out=y1).addcmul_(x2, s1, value=-1)
        torch.mul(x2, c2, out=y2).addcmul_(x1, s2)
    return out


class RotaryFunction(torch.autograd.Function):
    """(q, k) rotated by (cos, sin), broadcast over dimension `unsqueeze_dim` (the heads)."""

    @staticmethod
    def forward(ctx, q, k, cos, sin, unsqueeze_dim: int):  # type: ignore[override]
        cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
        ctx.save_for_backward(cos, sin)
        return _rotate(q, cos, sin, inverse=False), _rotate(k, cos, sin, inverse=False)

    @staticmethod
    def backward(ctx, grad_q, grad_k):  # type: ignore[override]
        cos, sin = ctx.saved_tensors
        dq = None if grad_q is None else _rotate(grad_q, cos, sin, inverse=True)
        dk = None if grad_k is None else _rotate(grad_k, cos, sin, inverse=True)
        return dq, dk, None, None, None


def _fits(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    return (
        q.device.type == "cpu"
        and q.dtype == k.dtype == cos.dtype == sin.dtype
        and q.shape[-1] == cos.shape[-1] == sin.shape[-1]
        and q.shape[-1] % 2 == 0
        and not (cos.requires_grad or sin.requires_grad)
    )


def fused(original: Callable) -> Callable:
    """`original`'s contract, through RotaryFunction where it fits (see the module docstring)."""

    def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
        if _fits(q, k, cos, sin):
            return RotaryFunction.apply(q, k, cos, sin, unsqueeze_dim)
        return original(q, k, cos, sin, unsqueeze_dim)

    setattr(apply_rotary_pos_emb, MARK, original)
    return apply_rotary_pos_emb


def install(module: ModuleType) -> bool:
    """Route `module.apply_rotary_pos_emb` through RotaryFunction; False (nothing changed) where the
    module has none with transformers' standard parameters. Installing twice changes nothing."""
    current = getattr(module, "apply_rotary_pos_emb", None)
    if current is None or hasattr(current, MARK):
        return current is not None
    if tuple(inspect.signature(current).parameters) != STANDARD_PARAMETERS:
        return False
    module.apply_rotary_pos_emb = fused(current)
    return True
