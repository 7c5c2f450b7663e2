"""RMSNorm as one autograd Function on the CPU: r = 1 / sqrt(mean(x^2) + eps), x^ = x r,

    y = x^ * w,    dw = sum over tokens of dy * x^,    dx = r * (g - x^ * mean(g * x^)),  g = dy * w,

keeping only r beside the input, instead of autograd through five element-wise calls. `install`
patches each standard norm instance (the rollout engine's copy is untouched); anything else (not
fp32 CPU, a DTensor weight, under autocast) runs the module's own forward.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from engines.kernels import cpu_kernels

# transformers classes whose forward is exactly weight * (x * rsqrt(mean(x^2) + variance_epsilon))
STANDARD = frozenset({"LlamaRMSNorm", "Qwen2RMSNorm", "MistralRMSNorm"})


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


def _fits(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (
        x.device.type == "cpu"
        and x.dtype == weight.dtype == torch.float32
        and not isinstance(weight, DTensor)
        and not torch.is_autocast_enabled("cpu")
    )


def _fused_forward(self: torch.nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    if _fits(hidden_states, self.weight):
        return RMSNormFunction.apply(hidden_states, self.weight, self.variance_epsilon)
    return type(self).forward(self, hidden_states)


def install(model: torch.nn.Module) -> int:
    """Give every standard RMSNorm in `model` RMSNormFunction's forward; returns how many."""
    return cpu_kernels.install_forward(model, STANDARD, _fused_forward)
