"""The critic's clipped value loss, with v_old the prediction at rollout time and G the return:

loss_t = 1/2 max((v - G)^2, (v_old + clip(v - v_old, -eps, eps) - G)^2);  vf_clip=None: 1/2 (v - G)^2
"""

from __future__ import annotations

import torch
from tensordict import TensorDict

from engines.training.base import GlobalCounts, LossFn
from workers.losses.aggregation import aggregate, check_agg_mode, token_fraction, token_mean


def make_value_loss(vf_clip: float | None = 0.2, agg_mode: str = "token-mean") -> LossFn:
    """The critic's LossFn: reads response_mask, values (old), returns and outputs values."""
    check_agg_mode(agg_mode)  # fail at construction, not at the first micro-batch
    if vf_clip is not None and vf_clip < 0:
        raise ValueError(f"vf_clip must be >= 0 (or None to disable clipping), got {vf_clip}")

    def value_loss(
        micro_batch: TensorDict, outputs: dict[str, torch.Tensor], counts: GlobalCounts
    ) -> tuple[torch.Tensor, dict[str, float]]:
        mask = micro_batch["response_mask"]
        vpred, returns = outputs["values"], micro_batch["returns"]
        unclipped = (vpred - returns).square()
        if vf_clip is None:
            loss_mat, clipped = 0.5 * unclipped, torch.zeros_like(mask, dtype=torch.bool)
        else:
            old = micro_batch["values"]
            vclipped = old + (vpred - old).clamp(-vf_clip, vf_clip)
            clipped_sq = (vclipped - returns).square()
            loss_mat, clipped = 0.5 * torch.maximum(unclipped, clipped_sq), clipped_sq > unclipped
        loss = aggregate(loss_mat, mask, agg_mode, counts)
        metrics = {
            "critic/vf_loss": float(loss.detach()),
            "critic/vf_clipfrac": token_fraction(clipped, mask, counts),
            "critic/vpred_mean": token_mean(vpred, mask, counts),
        }
        return loss, metrics

    return value_loss
