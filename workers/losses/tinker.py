"""The Tinker SDK's built-in losses on per-datum token log-probs (`compute_loss`).

Each is the registry's objective of the same name reduced with `sum`, as every Tinker loss page
writes `loss = -objective.sum()` (reported as `loss:sum`); no log-ratio bound, no ppo dual clip.
Clip bounds are `clip_low_threshold` / `clip_high_threshold` (config, or per token). Choices where
the pages are silent: cross_entropy sums -lp * w (the SDK's `forward_backward_custom` relies on
dL/dlp = -w); gspo's ratio is over `sequence_ratio_mask`, the loss over all tokens, bounds 0.8/1.2;
dro's beta defaults to 0.05; stable_reinforce, unpublished, is -sum sg(min(r, c)) lp A +
kl_coeff/2 sum (lp - q)^2 with c = `clip_high_threshold` (docs/tinker.md).
"""

from __future__ import annotations

from typing import Any

import torch

from schema.tinker_losses import SPECS, LossInputError, resolve_config
from workers.losses.aggregation import aggregate
from workers.losses.registry import LOSSES, TokenInputs

Tensor = torch.Tensor
assert set(SPECS) <= set(LOSSES), "every Tinker loss is a registered objective"


def _options(loss_fn: str, cfg: dict[str, float], inp: dict[str, Tensor]) -> dict[str, Any]:
    if loss_fn in ("ppo", "gspo", "cispo"):
        return {
            "low": inp.get("clip_low_threshold", cfg["clip_low_threshold"]),
            "high": inp.get("clip_high_threshold", cfg["clip_high_threshold"]),
        }
    if loss_fn == "stable_reinforce":
        return {"cap": cfg["clip_high_threshold"], "kl_coeff": cfg["kl_coeff"]}
    return dict(cfg)  # dro: beta; cross_entropy, importance_sampling: none


def _datum_loss(loss_fn: str, lp: Tensor, inp: dict[str, Tensor], cfg: dict[str, float]) -> Tensor:
    inp = {k: v.to(lp) for k, v in inp.items() if k != "target_tokens"}
    ratio_mask = inp.get("sequence_ratio_mask")
    inputs = TokenInputs(
        lp, inp.get("logprobs"), inp.get("advantages"), None if ratio_mask is None else ratio_mask != 0
    )
    terms = LOSSES[loss_fn](inputs, **_options(loss_fn, cfg, inp))
    return aggregate(terms.loss, inp["weights"] if loss_fn == "cross_entropy" else None, "sum")


def compute_loss(
    loss_fn: str,
    logprobs: list[Tensor],
    inputs: list[dict[str, Tensor]],
    config: dict[str, Any] | None,
) -> tuple[Tensor, list[dict[str, Tensor]], dict[str, float]]:
    """Sum of `loss_fn` over all data; per-datum outputs; metrics named as Tinker names them.

    `logprobs[i]` has the shape of `inputs[i]["target_tokens"]` ((N,), or (N, K) for top-K
    cross-entropy) and is autograd-connected; call `.backward()` on the returned scalar.
    """
    cfg = resolve_config(loss_fn, config)
    if len(logprobs) != len(inputs):
        raise LossInputError("data", f"{len(logprobs)} log-prob rows for {len(inputs)} data")
    spec = SPECS[loss_fn]
    total: Tensor | None = None
    outputs: list[dict[str, Tensor]] = []
    for i, (lp, inp) in enumerate(zip(logprobs, inputs, strict=True)):
        for name in spec.required:
            if name not in inp:
                raise LossInputError(f"data[{i}].loss_fn_inputs.{name}", "required")
        for name in inp.keys() & (spec.required.keys() | spec.optional.keys()):
            if tuple(inp[name].shape) != tuple(lp.shape):
                raise LossInputError(
                    f"data[{i}].loss_fn_inputs.{name}",
                    f"shape {tuple(inp[name].shape)} != log-probs {tuple(lp.shape)}",
                )
        term = _datum_loss(loss_fn, lp, inp, cfg)
        if not torch.isfinite(term):  # its backward would add NaN to the adapter's gradient
            raise LossInputError(
                f"data[{i}].loss_fn_inputs", f"its loss is {float(term.detach())}, not finite in float32"
            )
        total = term if total is None else total + term
        outputs.append({"logprobs": lp.detach()})
    assert total is not None, "compute_loss needs at least one datum"
    return total, outputs, {"loss:sum": float(total.detach())}
