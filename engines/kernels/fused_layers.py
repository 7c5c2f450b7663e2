"""transformers' standard RMSNorm, SiLU-gated MLP and rotary embedding as one autograd Function each on
a CPU, keeping less for the backward than autograd through their element-wise calls, run by the fused
kernels (cpu_kernels.py) where they fit. The `install_*` functions route a model's standard instances
(the rollout engine's copy is untouched); anything else (not fp32 CPU, a DTensor weight, under autocast,
mixed dtypes, cos/sin needing a gradient) runs the original. With r = 1 / sqrt(mean(x^2) + eps),
x^ = x r, s = sigmoid, and halves x1, x2 of a rotated vector:

    RMSNorm:  y = x^ * w,    dw = sum over tokens of dy * x^,    dx = r * (g - x^ * mean(g * x^)),  g = dy * w
    SwiGLU:   y = g s(g) u,    dg = dy u s(g) (1 + g (1 - s(g))),    du = dy g s(g)
    rotary:   y1 = x1 cos1 - x2 sin1,    y2 = x2 cos2 + x1 sin2;    the backward is the inverse rotation.

The MLP's projections are called as before, so LoRA layers keep working.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from types import ModuleType

import torch
from torch.distributed.tensor import DTensor

from engines.kernels import cpu_kernels

# transformers classes whose forward is exactly weight * (x * rsqrt(mean(x^2) + variance_epsilon))
NORMS = frozenset({"LlamaRMSNorm", "Qwen2RMSNorm", "MistralRMSNorm"})


class RMSNormFunction(torch.autograd.Function):
    """y = x / sqrt(mean(x^2, -1) + eps) * weight."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:  # type: ignore[override]
        fused = cpu_kernels.kernels() if cpu_kernels.fits(x, weight) else None
        ctx.fused = fused
        if fused is not None:
            y, rstd = fused.rms_norm_forward(x, weight, eps)
            ctx.save_for_backward(x, weight, rstd)
            return y
        squares = torch.linalg.vector_norm(x, dim=-1, keepdim=True).square_()
        rstd = squares.div_(x.shape[-1]).add_(eps).rsqrt_()
        ctx.save_for_backward(x, weight, rstd)
        return torch.mul(x, rstd).mul_(weight)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        x, weight, rstd = ctx.saved_tensors
        if ctx.fused is not None:
            grad_x, grad_weight = ctx.fused.rms_norm_backward(grad, x, weight, rstd)
            return grad_x, grad_weight if ctx.needs_input_grad[1] else None, None
        normed = x * rstd
        grad_weight = None
        if ctx.needs_input_grad[1]:
            grad_weight = (grad * normed).flatten(0, -2).sum(0)
        grad_x = None
        if ctx.needs_input_grad[0]:
            scaled = grad * weight
            mean = torch.linalg.vecdot(scaled, normed).unsqueeze(-1).div_(x.shape[-1])
            grad_x = scaled.sub_(normed.mul_(mean)).mul_(rstd)
        return grad_x, grad_weight, None


def _norm_fits(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (
        x.device.type == "cpu"
        and x.dtype == weight.dtype == torch.float32
        and not isinstance(weight, DTensor)
        and not torch.is_autocast_enabled("cpu")
    )


def _norm_forward(self: torch.nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    if _norm_fits(hidden_states, self.weight):
        return RMSNormFunction.apply(hidden_states, self.weight, self.variance_epsilon)
    return type(self).forward(self, hidden_states)


def install_rms_norm(model: torch.nn.Module) -> int:
    """Give every standard RMSNorm in `model` RMSNormFunction's forward; returns how many."""
    return cpu_kernels.install_forward(model, NORMS, _norm_forward)


MLPS = frozenset({"LlamaMLP", "Qwen2MLP", "MistralMLP"})


class SwiGLUFunction(torch.autograd.Function):
    """silu(gate) * up through the fused kernels (the caller checks `cpu_kernels.fits`)."""

    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor, fused: cpu_kernels.CpuKernels) -> torch.Tensor:  # type: ignore[override]
        ctx.fused = fused
        ctx.save_for_backward(gate, up)
        return fused.swiglu_forward(gate, up)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        gate, up = ctx.saved_tensors
        grad_gate, grad_up = ctx.fused.swiglu_backward(grad, gate, up)
        return grad_gate, grad_up, None


def swiglu(gate: torch.Tensor, up: torch.Tensor, act_fn) -> torch.Tensor:
    """`act_fn(gate) * up`, fused where the kernels take the tensors."""
    fused = cpu_kernels.kernels() if cpu_kernels.fits(gate, up) and gate.shape == up.shape else None
    if fused is None:
        return act_fn(gate) * up
    return SwiGLUFunction.apply(gate, up, fused)


def _mlp_forward(self: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x), self.act_fn))


def install_swiglu(model: torch.nn.Module) -> int:
    """Give every standard SiLU-gated MLP in `model` the fused forward; returns how many."""
    return cpu_kernels.install_forward(
        model,
        MLPS,
        _mlp_forward,
        lambda m: getattr(getattr(m, "config", None), "hidden_act", None) == "silu",
    )


ROTARY_PARAMETERS = ("q", "k", "cos", "sin", "unsqueeze_dim")
ROTARY_MARK = "_tandem_rotary_original"


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


def _rotary_fits(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    return (
        q.device.type == "cpu"
        and q.dtype == k.dtype == cos.dtype == sin.dtype
        and q.shape[-1] == cos.shape[-1] == sin.shape[-1]
        and q.shape[-1] % 2 == 0
        and not (cos.requires_grad or sin.requires_grad)
    )


def fused_rotary(original: Callable) -> Callable:
    """`original`'s contract, through RotaryFunction where it fits."""

    def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
        if _rotary_fits(q, k, cos, sin):
            return RotaryFunction.apply(q, k, cos, sin, unsqueeze_dim)
        return original(q, k, cos, sin, unsqueeze_dim)

    setattr(apply_rotary_pos_emb, ROTARY_MARK, original)
    return apply_rotary_pos_emb


def install_rotary(module: ModuleType) -> bool:
    """Route `module.apply_rotary_pos_emb` through RotaryFunction (idempotent); False where it has none
    with the standard parameters."""
    current = getattr(module, "apply_rotary_pos_emb", None)
    if current is None or hasattr(current, ROTARY_MARK):
        return current is not None
    if tuple(inspect.signature(current).parameters) != ROTARY_PARAMETERS:
        return False
    module.apply_rotary_pos_emb = fused_rotary(current)
    return True
