"""The Tinker SDK's built-in losses on per-datum token log-probs (`compute_loss`).

Each is the loss registry's objective of the same name (registry.py, where the formulas are),
reduced with `sum`: every Tinker loss page implements `loss = -objective.sum()` over tokens and
data, no mean, and reports it as `loss:sum`. Per datum and token t: lp_t = the model's log-prob of
`target_tokens[t]` (autograd-connected), the behaviour log-prob is the input `logprobs` (the
sampler's), A_t = `advantages[t]`, w_t = `weights[t]`; the clip bounds are the ratio bounds
`clip_low_threshold` / `clip_high_threshold` (config, default 0.8/1.2; a per-token input of the same
name overrides it position by position). Unlike an RL job, the log-ratio is not bounded before exp
and ppo has no dual clip, as the pages write them. Sources and the choices where they are silent:

- cross_entropy: sum_t -lp_t * w_t, docs page "Cross-Entropy"; with (N, K) inputs the same sum over
  all K candidates (top-K distillation). This exact linear form is what the SDK's client-side
  `forward_backward_custom` relies on: it sends `weights = -dC/dlogprobs`
  (`tinker/lib/public_interfaces/training_client.py::_compute_custom_loss`), so dL/dlp = -w.
  The RL losses ignore `weights` and sum over every token.
- importance_sampling, ppo (token-wise), cispo, dro: their docs pages. DRO's page shows
  `{"beta": 0.05}` as a custom value without stating the default; Tandem's default is 0.05.
- gspo: docs page "GSPO": the sequence ratio is over the tokens where `sequence_ratio_mask` != 0,
  the loss summed over ALL tokens (the docs' formula sums over t; prompt positions carry A = 0 in
  the cookbook's `rl_loop.py`). The GSPO paper's much tighter ranges (3e-4/4e-4) are not Tinker's
  stated default, so gspo shares 0.8/1.2 with ppo/cispo. An empty mask gives a ratio of 1.
- stable_reinforce: Tinker's exact objective is not published (the docs page, "alpha", describes
  a REINFORCE variant that uses stability info recorded at sampling time and `sequence_id`
  provenance, which this contract does not carry). Tandem's choice, stated here and in
  docs/tinker.md: truncated-importance-weighted REINFORCE with an optional quadratic KL penalty to
  the sampler, -sum_t sg(min(r_t, c)) lp_t A_t + kl_coeff/2 sum_t (lp_t - q_t)^2, with
  c = `clip_high_threshold` (default 2.0) and `kl_coeff` (default 0; the proto's example is 0.01).
  On-policy (lp = q) its gradient equals importance_sampling's.

Outputs per datum: {"logprobs": lp (detached)}, as every loss page lists. Metrics: {"loss:sum"}.
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
    """The registry objective's keywords from the resolved config and the per-token inputs."""
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
        total = term if total is None else total + term
        outputs.append({"logprobs": lp.detach()})
    assert total is not None, "compute_loss needs at least one datum"
    return total, outputs, {"loss:sum": float(total.detach())}
