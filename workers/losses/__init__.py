"""Every built-in loss: the registry of per-token objectives (registry.py) and their reductions
(aggregation.py). RL and SFT losses are LossFn factories following engines/training/base.py's contract: each
returns a scalar and metrics divided by the whole batch's global counts, so they add up over
micro-batches and ranks. tinker.py is the Tinker API's `compute_loss`.
"""

from engines.training.base import LossFn
from schema.losses import LossSpec, SFTLossConfig, ValueLossConfig
from workers.losses.aggregation import AGG_MODES, aggregate
from workers.losses.kl import kl_estimate
from workers.losses.policy import PolicyLossConfig, make_policy_loss, rows_with_gradient
from workers.losses.registry import LOSSES, objective
from workers.losses.sft import make_sft_loss
from workers.losses.value import make_value_loss


def make_loss(spec: LossSpec) -> LossFn:
    if isinstance(spec, PolicyLossConfig):
        return make_policy_loss(spec)
    if isinstance(spec, SFTLossConfig):
        return make_sft_loss(spec.loss_agg_mode)
    if isinstance(spec, ValueLossConfig):
        return make_value_loss(spec.vf_clip, spec.loss_agg_mode)
    raise TypeError(f"a loss is given by its options (schema.losses.LossSpec), not {type(spec).__name__}")


__all__ = [
    "AGG_MODES",
    "LOSSES",
    "PolicyLossConfig",
    "aggregate",
    "kl_estimate",
    "make_loss",
    "make_policy_loss",
    "make_sft_loss",
    "make_value_loss",
    "objective",
    "rows_with_gradient",
]
