"""SwiGLU, `silu(gate) * up`, as one autograd Function over the fused CPU kernels:

    y = g s(g) u,    dg = dy u s(g) (1 + g (1 - s(g))),    du = dy g s(g),    s = sigmoid,

keeping only gate and up. `install` patches each standard SiLU MLP instance; the projections are
called as before, so LoRA layers keep working.
"""

from __future__ import annotations

import torch

from engines.kernels import cpu_kernels

STANDARD = frozenset({"LlamaMLP", "Qwen2MLP", "MistralMLP"})


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


def _fused_forward(self: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x), self.act_fn))


def install(model: torch.nn.Module) -> int:
    """Give every standard SiLU-gated MLP in `model` the fused forward; returns how many."""
    return cpu_kernels.install_forward(
        model,
        STANDARD,
        _fused_forward,
        lambda m: getattr(getattr(m, "config", None), "hidden_act", None) == "silu",
    )
