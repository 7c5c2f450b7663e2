"""Options of the RL losses that JobSpec embeds as they are, so that they are declared once.

Torch-free on purpose: JobSpec (and with it the CLI, which never imports torch) reads this module,
while workers/losses/ holds the arithmetic that the options select.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

AggMode = Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
KLType = Literal["k1", "k2", "k3"]


class RolloutCorrectionConfig(BaseModel):
    """Importance-sampling correction for the gap between the rollout engine and the trainer.

    The rollout engine (another kernel, another precision, sometimes another library) samples from
    a policy slightly different from the trainer's, though both hold the same weights. The ratio
    rho = pi_trainer(y) / pi_rollout(y) measures that gap per token; workers/losses/
    rollout_correction.py has the formulas and their sources. Everything is off by default.
    """

    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    is_weights: Literal["off", "token", "sequence"] = Field(
        "off",
        description="truncated importance sampling (TIS): multiply each token's policy loss by "
        "min(rho, is_cap), with rho the token's ratio ('token') or the product of its sequence's "
        "ratios ('sequence'); works also when the old log-prob pass is skipped",
    )
    is_cap: float = Field(
        2.0,
        ge=1,
        le=1e6,
        description="the cap C of the truncated IS weight min(rho, C) (Yao et al. 2025 use 2)",
    )
    rejection: Literal["off", "token", "sequence", "geometric"] = Field(
        "off",
        description="masked IS / rejection: drop from the loss the tokens whose ratio leaves "
        "[rejection_low, rejection_high] ('token'), or whole sequences whose product of ratios "
        "('sequence') or geometric mean of ratios ('geometric') leaves it; needs the separate old "
        "log-prob pass, which a job with rejection always runs",
    )
    rejection_low: float = Field(0.5, gt=0, le=1, description="lower edge of the accepted ratio band")
    rejection_high: float = Field(2.0, ge=1, le=1e6, description="upper edge of the accepted ratio band")

    @model_validator(mode="after")
    def _band_is_not_empty(self) -> RolloutCorrectionConfig:
        if self.rejection_low >= self.rejection_high:
            raise ValueError(
                f"rollout_correction.rejection_low ({self.rejection_low}) must be below "
                f"rejection_high ({self.rejection_high})"
            )
        return self

    @property
    def enabled(self) -> bool:
        return self.is_weights != "off" or self.rejection != "off"


class PolicyLossConfig(BaseModel):
    """The actor loss (workers/losses/policy.py). JobSpec.algorithm inherits these fields."""

    model_config = ConfigDict(extra="forbid")

    policy_loss: Literal["ppo", "gspo", "cispo"] = Field("ppo", description="the per-token objective")
    clip_ratio_low: float = Field(
        0.2, ge=0, le=100, description="lower clip: ratios below 1 - this are clipped"
    )
    clip_ratio_high: float = Field(
        0.2, ge=0, le=100, description="upper clip: ratios above 1 + this are clipped"
    )
    clip_ratio_c: float = Field(3.0, gt=1, le=1e6, description="PPO dual clip: cap of the loss where A < 0")
    loss_agg_mode: AggMode = Field("token-mean", description="how token losses become one scalar")
    entropy_coeff: float = Field(
        0.0, ge=-100, le=100, description="weight of the entropy bonus (needs outputs['entropy'])"
    )
    use_kl_loss: bool = Field(False, description="add KL(pi || pi_ref) as a loss (needs ref_log_probs)")
    kl_loss_coef: float = Field(0.001, ge=0, le=1e6, description="weight of the KL loss")
    kl_loss_type: KLType = Field("k3", description="KL estimator: k1, k2 or k3 (low-variance)")
    rollout_correction: RolloutCorrectionConfig = Field(
        default_factory=RolloutCorrectionConfig,
        description="correction for the gap between the rollout engine's and the trainer's log-probs: "
        "truncated importance weights (applied by the loss) and rejection of tokens or sequences "
        "(applied to the response mask before the update); off by default",
    )


class SFTLossConfig(BaseModel):
    """Supervised fine-tuning: the cross-entropy of the response tokens (workers/losses/sft.py)."""

    model_config = ConfigDict(extra="forbid")

    loss_agg_mode: AggMode = Field("token-mean", description="how token losses become one scalar")


class ValueLossConfig(BaseModel):
    """The critic's clipped value loss (workers/losses/value.py)."""

    model_config = ConfigDict(extra="forbid")

    vf_clip: float | None = Field(0.2, ge=0, description="clip of the value update; None = unclipped")
    loss_agg_mode: AggMode = Field("token-mean", description="how token losses become one scalar")


# What a `forward_backward` worker operation takes as its loss (workers/operations.py): the options
# of one of the built-in losses, built into a LossFn inside the worker (workers.losses.make_loss).
LossSpec = PolicyLossConfig | SFTLossConfig | ValueLossConfig
