"""RL and SFT losses as LossFn factories that follow engines/base.py's loss contract.

A loss function gets one micro-batch, the model outputs for it and the global counts of the whole
batch; it returns a scalar and additive metrics, both divided by those global counts, so the engine
can sum them over micro-batches and ranks. aggregation.py holds the reductions, kl.py the KL
estimators, policy.py the actor objectives (PPO, GSPO, CISPO), value.py the critic, sft.py SFT.
"""

from engines.base import LossFn
from workers.loss_config import LossSpec, SFTLossConfig, ValueLossConfig
from workers.losses.aggregation import AGG_MODES, AggMode, aggregate, check_agg_mode
from workers.losses.kl import KL_TYPES, KLType, kl_estimate
from workers.losses.policy import (
    PolicyLossConfig,
    TokenPolicyLoss,
    cispo_token_loss,
    gspo_token_loss,
    make_policy_loss,
    make_token_objective,
    ppo_token_loss,
    rows_with_gradient,
)
from workers.losses.sft import make_sft_loss
from workers.losses.value import make_value_loss


def make_loss(spec: LossSpec) -> LossFn:
    """The LossFn of a loss's options (workers.loss_config.LossSpec)."""
    if isinstance(spec, PolicyLossConfig):
        return make_policy_loss(spec)
    if isinstance(spec, SFTLossConfig):
        return make_sft_loss(spec.loss_agg_mode)
    if isinstance(spec, ValueLossConfig):
        return make_value_loss(spec.vf_clip, spec.loss_agg_mode)
    raise TypeError(
        f"a loss is given by its options (workers.loss_config.LossSpec), not {type(spec).__name__}"
    )


__all__ = [
    "AGG_MODES",
    "KL_TYPES",
    "AggMode",
    "KLType",
    "PolicyLossConfig",
    "TokenPolicyLoss",
    "aggregate",
    "check_agg_mode",
    "cispo_token_loss",
    "gspo_token_loss",
    "kl_estimate",
    "make_policy_loss",
    "make_loss",
    "make_sft_loss",
    "make_token_objective",
    "make_value_loss",
    "ppo_token_loss",
    "rows_with_gradient",
]
