"""Rotary position embedding as one autograd Function on the CPU. With halves x1, x2:

    y1 = x1 cos1 - x2 sin1,    y2 = x2 cos2 + x1 sin2;    the backward is the inverse rotation,

four in-place calls (or one fused kernel pass) each way instead of transformers' seven fresh
tensors. `install` routes a modeling module's standard `apply_rotary_pos_emb` through it; anything
else (a GPU tensor, mixed dtypes as under autocast, cos/sin needing a gradient) goes to the original.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from types import ModuleType

import torch

from engines.kernels import cpu_kernels

STANDARD_PARAMETERS = ("q", "k", "cos", "sin", "unsqueeze_dim")
MARK = "_tandem_rotary_original"


def _halves(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    half = x.shape[-1] // 2
    return x[..., :half], x[..., half:]


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool) -> torch.Tensor:
    """y = R x (or R^T x with `inverse`), laid out as x; the fused kernel where it fits."""
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
    """`original`'s contract, through RotaryFunction where it fits."""

    def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
        if _fits(q, k, cos, sin):
            return RotaryFunction.apply(q, k, cos, sin, unsqueeze_dim)
        return original(q, k, cos, sin, unsqueeze_dim)

    setattr(apply_rotary_pos_emb, MARK, original)
    return apply_rotary_pos_emb


def install(module: ModuleType) -> bool:
    """Route `module.apply_rotary_pos_emb` through RotaryFunction (idempotent); False where it has none
    with the standard parameters."""
    current = getattr(module, "apply_rotary_pos_emb", None)
    if current is None or hasattr(current, MARK):
        return current is not None
    if tuple(inspect.signature(current).parameters) != STANDARD_PARAMETERS:
        return False
    module.apply_rotary_pos_emb = fused(current)
    return True
