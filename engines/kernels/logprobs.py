"""Log-probabilities (and entropy) of target tokens without a full-vocabulary fp32 tensor.

`ChunkedLogProbs` projects `chunk` tokens at a time and keeps only two numbers per token
(log-normaliser, entropy); its backward recomputes each chunk's logits once and forms their gradient
in closed form, d log p(t)/dz = onehot(t) - p and dH/dz = -p (log p + H), or takes the forward's
log-softmax when it fits `keep_bytes`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engines.kernels import cpu_kernels


def _accumulate_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 for bf16/fp16/fp32 compute; fp64 stays fp64 (gradcheck)."""
    return torch.promote_types(dtype, torch.float32)


def _chunk_logits(hidden: torch.Tensor, weight: torch.Tensor, temperature: float) -> torch.Tensor:
    logits = F.linear(hidden, weight).to(_accumulate_dtype(hidden.dtype))
    if temperature != 1.0:
        logits.div_(temperature)
    return logits


def _add_weight_grad(
    grad_weight: torch.Tensor | None, grad_logits: torch.Tensor, hidden: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """grad_weight (fp32) += grad_logits.T @ hidden (None: the first product, no zero-fill). On CUDA with
    bf16/fp16 inputs on the tensor cores with an fp32 result; casting up first would be a slow fp32 matmul."""
    if hidden.is_cuda and hidden.dtype in (torch.bfloat16, torch.float16):
        product = torch.mm(grad_logits.t(), hidden, out_dtype=dtype)
        return product if grad_weight is None else grad_weight.add_(product)
    grad_logits, hidden = grad_logits.t().to(dtype), hidden.to(dtype)
    return torch.mm(grad_logits, hidden) if grad_weight is None else grad_weight.addmm_(grad_logits, hidden)


BLOCK_ELEMENTS = 1 << 19  # 2 MB of fp32 logits


def _row_blocks(start: int, end: int, vocab: int, device: torch.device):
    """Row slices of about BLOCK_ELEMENTS logits: on a CPU the element-wise passes run block by block,
    from cache rather than memory; on a GPU one block (each block costs kernel launches)."""
    if device.type != "cpu":
        yield slice(start, end)
        return
    step = max(1, BLOCK_ELEMENTS // vocab)
    for first in range(start, end, step):
        yield slice(first, min(first + step, end))


def _logit_grad(log_p: torch.Tensor, targets: torch.Tensor, grad_log_probs, entropy_and_grad) -> None:
    """Overwrite a block of log p [rows, V] with the gradient of the loss with respect to its logits."""
    probs = log_p.exp()
    if entropy_and_grad is not None:  # dH/dz = -p (log p + H)
        entropy, grad_entropy = entropy_and_grad
        log_p.add_(entropy).mul_(probs).mul_(-grad_entropy)
        if grad_log_probs is not None:
            log_p.sub_(probs.mul_(grad_log_probs))
    else:
        torch.mul(probs, -grad_log_probs, out=log_p)
    if grad_log_probs is not None:  # d log p(t)/dz = onehot(t) - p
        log_p.scatter_add_(-1, targets[:, None], grad_log_probs)


class ChunkedLogProbs(torch.autograd.Function):
    """(log_probs [N], entropy [N] or [0]) of `targets` under softmax(hidden @ weight.T / temperature)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        targets: torch.Tensor,
        temperature: float,
        with_entropy: bool,
        chunk: int,
        keep_bytes: int = 0,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        n, dtype = hidden.shape[0], _accumulate_dtype(hidden.dtype)
        wants_grad = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
        keep = wants_grad and n * weight.shape[0] * dtype.itemsize <= keep_bytes
        kept: list[torch.Tensor | None] = []
        log_probs = torch.empty(n, dtype=dtype, device=hidden.device)
        log_norm = torch.empty_like(log_probs)
        entropy = torch.empty(n if with_entropy else 0, dtype=dtype, device=hidden.device)
        for start in range(0, n, chunk):
            end = min(start + chunk, n)
            logits = _chunk_logits(hidden[start:end], weight, temperature)
            fused = cpu_kernels.kernels() if cpu_kernels.fits(logits) else None
            if fused is not None:  # one kernel over the chunk's rows (engines/kernels/cpu_kernels.c)
                lp, lse, ent = fused.log_softmax_stats(logits, targets[start:end], with_entropy, keep)
                log_probs[start:end], log_norm[start:end] = lp, lse
                if ent is not None:
                    entropy[start:end] = ent
                if keep:
                    kept.append(logits)
                continue
            for rows in _row_blocks(start, end, logits.shape[1], logits.device):
                block = logits[rows.start - start : rows.stop - start]
                lse = torch.logsumexp(block, dim=-1)
                log_norm[rows] = lse
                log_probs[rows] = block.gather(-1, targets[rows, None]).squeeze(-1) - lse
                if with_entropy or keep:
                    block.sub_(lse[:, None])  # log p
                if with_entropy:  # H = -sum(p log p)
                    entropy[rows] = -torch.linalg.vecdot(block.exp(), block)
            if keep:
                kept.append(logits)
        ctx.save_for_backward(hidden, weight, targets, log_norm, entropy)
        ctx.temperature, ctx.chunk, ctx.kept = temperature, chunk, kept
        ctx.set_materialize_grads(False)
        ctx.mark_non_differentiable(*(() if with_entropy else (entropy,)))
        return log_probs, entropy

    @staticmethod
    def backward(ctx, grad_log_probs: torch.Tensor | None, grad_entropy: torch.Tensor | None):  # type: ignore[override]
        hidden, weight, targets, log_norm, entropy = ctx.saved_tensors
        if entropy.numel() == 0:
            grad_entropy = None
        want_hidden, want_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if (grad_log_probs is None and grad_entropy is None) or not (want_hidden or want_weight):
            return None, None, None, None, None, None, None
        grad_hidden = torch.empty_like(hidden) if want_hidden else None
        dtype = _accumulate_dtype(hidden.dtype)
        grad_weight = None
        kept, ctx.kept = ctx.kept, []  # a second backward (retain_graph) recomputes
        for index, start in enumerate(range(0, hidden.shape[0], ctx.chunk)):
            end = min(start + ctx.chunk, hidden.shape[0])
            shift = None  # what the values less is log p: None where they are log p already
            if kept:
                log_p, kept[index] = kept[index], None  # consumed in place below; freed as we go
            else:
                log_p, shift = _chunk_logits(hidden[start:end], weight, ctx.temperature), log_norm[start:end]
            fused = cpu_kernels.kernels() if cpu_kernels.fits(log_p) else None
            if fused is not None:  # one pass over the chunk, log p formed on the way
                fused.log_softmax_grad(
                    log_p, shift, targets[start:end],
                    None if grad_log_probs is None else grad_log_probs[start:end],
                    None if grad_entropy is None else entropy[start:end],
                    None if grad_entropy is None else grad_entropy[start:end],
                )  # fmt: skip
            else:
                if shift is not None:
                    log_p.sub_(shift[:, None])
                for rows in _row_blocks(start, end, log_p.shape[1], log_p.device):
                    _logit_grad(
                        log_p[rows.start - start : rows.stop - start],
                        targets[rows],
                        None if grad_log_probs is None else grad_log_probs[rows, None],
                        None if grad_entropy is None else (entropy[rows, None], grad_entropy[rows, None]),
                    )
            grad_logits = log_p
            if ctx.temperature != 1.0:
                grad_logits.div_(ctx.temperature)
            grad_logits = grad_logits.to(hidden.dtype)
            if grad_hidden is not None:
                grad_hidden[start:end] = grad_logits @ weight
            if want_weight:
                grad_weight = _add_weight_grad(grad_weight, grad_logits, hidden[start:end], dtype)
        grad_weight = grad_weight.to(weight.dtype) if grad_weight is not None else None
        return grad_hidden, grad_weight, None, None, None, None, None


def token_log_probs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    temperature: float = 1.0,
    with_entropy: bool = False,
    chunk_tokens: int = 1024,
    keep_bytes: int = 0,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log p(targets[i] | hidden[i]) for hidden [N, H], weight [V, H]; and the entropy when asked.

    Under CPU autocast the projection runs in fp32: bf16 logits would round every log-prob and ratio."""
    if hidden.device.type == "cpu" and torch.is_autocast_enabled("cpu"):
        with torch.autocast("cpu", enabled=False):
            hidden, weight = hidden.float(), weight.float()
            return token_log_probs(
                hidden, weight, targets, temperature, with_entropy, chunk_tokens, keep_bytes
            )
    log_probs, entropy = ChunkedLogProbs.apply(
        hidden, weight, targets, temperature, with_entropy, chunk_tokens, keep_bytes
    )
    return log_probs, (entropy if with_entropy else None)
