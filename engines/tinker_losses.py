"""The Tinker SDK's built-in losses on per-datum token log-probs (`compute_loss`).

Notation, per datum and token t: lp_t = the model's log-prob of `target_tokens[t]` (autograd-
connected), q_t = the sampler's log-prob (input `logprobs`), A_t = `advantages[t]`, w_t =
`weights[t]`, r_t = exp(lp_t - q_t), sg = stop-gradient, clip(x) = clamp(x, lo, hi) with lo/hi =
`clip_low_threshold`/`clip_high_threshold` (config, default 0.8/1.2; a per-token input of the same
name overrides it position by position). Every loss is a SUM over tokens and data, no mean: each
Tinker loss page implements `loss = -objective.sum()` and reports it as `loss:sum`.

- cross_entropy: L = sum_t -lp_t * w_t. Docs page "Cross-Entropy" (`elementwise_loss =
  -target_logprobs * weights; loss = elementwise_loss.sum()`); with (N, K) inputs the same sum over
  all K candidates (top-K distillation). This exact linear form is what the SDK's client-side
  `forward_backward_custom` relies on: it sends `weights = -dC/dlogprobs`
  (`tinker/lib/public_interfaces/training_client.py::_compute_custom_loss`), so dL/dlp = -w.
- importance_sampling: L = -sum_t r_t * A_t. Docs page "Importance Sampling".
- ppo: L = -sum_t min(r_t * A_t, clip(r_t) * A_t). Docs page "PPO" (token-wise).
- cispo: L = -sum_t sg(clip(r_t)) * lp_t * A_t. Docs page "CISPO".
- dro: L = -sum_t [lp_t * A_t - beta/2 * (lp_t - q_t)^2]. Docs page "DRO". The page shows
  `{"beta": 0.05}` as a custom value without stating the default; Tandem's default is 0.05.
- gspo: GSPO-token, docs page "GSPO": over the tokens M where `sequence_ratio_mask` != 0,
  s = exp(mean_{t in M}(sg(lp_t) - q_t)); each token's ratio s_t = exp(log s + lp_t - sg(lp_t))
  (s's value, lp_t's gradient); L = -sum_t min(s_t * A_t, clip(s_t) * A_t), summed over ALL tokens
  (the docs' formula sums over t; prompt positions carry A = 0 in the cookbook's `rl_loop.py`).
  The docs keep the clip thresholds' names; the GSPO paper's much tighter ranges (3e-4/4e-4) are
  not Tinker's stated default, so gspo shares 0.8/1.2 with ppo/cispo. An empty mask gives s = 1.
- stable_reinforce: Tinker's exact objective is not published (the docs page, "alpha", describes
  a REINFORCE variant that uses stability info recorded at sampling time and `sequence_id`
  provenance, which this contract does not carry). Tandem's choice, stated here and in
  docs/tinker.md: truncated-importance-weighted REINFORCE with an optional quadratic KL penalty to
  the sampler, L = -sum_t sg(min(r_t, c)) * lp_t * A_t + kl_coeff/2 * sum_t (lp_t - q_t)^2, with
  c = `clip_high_threshold` (default 2.0) and `kl_coeff` (default 0; the proto's example is 0.01).
  On-policy (lp = q) its gradient equals importance_sampling's.

Outputs per datum: {"logprobs": lp (detached)}, as every loss page lists. Metrics: {"loss:sum"}.
"""

from __future__ import annotations

from typing import Any

import torch

from engines.tinker_loss_spec import SPECS, LossInputError, resolve_config

Tensor = torch.Tensor


def _clip_bounds(inp: dict[str, Tensor], cfg: dict[str, float], like: Tensor) -> tuple[Tensor, Tensor]:
    lo = inp.get("clip_low_threshold")
    hi = inp.get("clip_high_threshold")
    lo = torch.full_like(like, cfg["clip_low_threshold"]) if lo is None else lo.to(like)
    hi = torch.full_like(like, cfg["clip_high_threshold"]) if hi is None else hi.to(like)
    return lo, hi


def _ratio(lp: Tensor, inp: dict[str, Tensor]) -> Tensor:
    return torch.exp(lp - inp["logprobs"].to(lp))


def _cross_entropy(lp: Tensor, inp: dict[str, Tensor], cfg: dict[str, float]) -> Tensor:
    return (-lp * inp["weights"].to(lp)).sum()


def _importance_sampling(lp: Tensor, inp: dict[str, Tensor], cfg: dict[str, float]) -> Tensor:
    return -(_ratio(lp, inp) * inp["advantages"].to(lp)).sum()


def _ppo(lp: Tensor, inp: dict[str, Tensor], cfg: dict[str, float]) -> Tensor:
    ratio, adv = _ratio(lp, inp), inp["advantages"].to(lp)
    lo, hi = _clip_bounds(inp, cfg, lp)
    clipped = torch.minimum(torch.maximum(ratio, lo), hi)
    return -torch.minimum(ratio * adv, clipped * adv).sum()


def _cispo(lp: Tensor, inp: dict[str, Tensor], cfg: dict[str, float]) -> Tensor:
    lo, hi = _clip_bounds(inp, cfg, lp)
    clipped = torch.minimum(torch.maximum(_ratio(lp, inp), lo), hi).detach()
    return -(clipped * lp * inp["advantages"].to(lp)).sum()


def _dro(lp: Tensor, inp: dict[str, Tensor], cfg: dict[str, float]) -> Tensor:
    quad = (lp - inp["logprobs"].to(lp)) ** 2
    return -(lp * inp["advantages"].to(lp) - 0.5 * cfg["beta"] * quad).sum()


def _gspo(lp: Tensor, inp: dict[str, Tensor], cfg: dict[str, float]) -> Tensor:
    in_ratio = inp["sequence_ratio_mask"] != 0
    token_log_ratio = lp.detach() - inp["logprobs"].to(lp)
    # An empty mask has no sequence ratio to take: s = 1 (log s = 0) rather than NaN.
    seq_log_ratio = token_log_ratio[in_ratio].mean() if bool(in_ratio.any()) else lp.new_zeros(())
    ratio = torch.exp(seq_log_ratio + lp - lp.detach())
    adv = inp["advantages"].to(lp)
    lo, hi = _clip_bounds(inp, cfg, lp)
    clipped = torch.minimum(torch.maximum(ratio, lo), hi)
    return -torch.minimum(ratio * adv, clipped * adv).sum()


def _stable_reinforce(lp: Tensor, inp: dict[str, Tensor], cfg: dict[str, float]) -> Tensor:
    weight = torch.clamp(_ratio(lp, inp), max=cfg["clip_high_threshold"]).detach()
    pg = -(weight * lp * inp["advantages"].to(lp)).sum()
    return pg + 0.5 * cfg["kl_coeff"] * ((lp - inp["logprobs"].to(lp)) ** 2).sum()


_LOSSES = {
    "cross_entropy": _cross_entropy,
    "importance_sampling": _importance_sampling,
    "ppo": _ppo,
    "cispo": _cispo,
    "dro": _dro,
    "gspo": _gspo,
    "stable_reinforce": _stable_reinforce,
}
assert set(_LOSSES) == set(SPECS)


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
    fn = _LOSSES[loss_fn]
    total: Tensor | None = None
    outputs: list[dict[str, Tensor]] = []
    for i, (lp, inp) in enumerate(zip(logprobs, inputs, strict=True)):
        spec = SPECS[loss_fn]
        for name in spec.required:
            if name not in inp:
                raise LossInputError(f"data[{i}].loss_fn_inputs.{name}", "required")
        for name in inp.keys() & (spec.required.keys() | spec.optional.keys()):
            if tuple(inp[name].shape) != tuple(lp.shape):
                raise LossInputError(
                    f"data[{i}].loss_fn_inputs.{name}",
                    f"shape {tuple(inp[name].shape)} != log-probs {tuple(lp.shape)}",
                )
        term = fn(lp, inp, cfg)
        total = term if total is None else total + term
        outputs.append({"logprobs": lp.detach()})
    assert total is not None, "compute_loss needs at least one datum"
    return total, outputs, {"loss:sum": float(total.detach())}
