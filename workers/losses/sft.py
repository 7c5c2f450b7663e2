"""Supervised fine-tuning: the cross-entropy of the response tokens, -log pi(y_t), aggregated."""

from __future__ import annotations

import torch
from tensordict import TensorDict

from engines.training.base import GlobalCounts, LossFn
from workers.losses.aggregation import aggregate, check_agg_mode
from workers.losses.registry import TokenInputs, cross_entropy


def make_sft_loss(agg_mode: str = "token-mean") -> LossFn:
    """The SFT LossFn: reads response_mask and outputs log_probs."""
    check_agg_mode(agg_mode)  # fail at construction, not at the first micro-batch

    def sft_loss(
        micro_batch: TensorDict, outputs: dict[str, torch.Tensor], counts: GlobalCounts
    ) -> tuple[torch.Tensor, dict[str, float]]:
        token_loss = cross_entropy(TokenInputs(outputs["log_probs"])).loss
        loss = aggregate(token_loss, micro_batch["response_mask"], agg_mode, counts)
        return loss, {"sft/loss": float(loss.detach())}

    return sft_loss
