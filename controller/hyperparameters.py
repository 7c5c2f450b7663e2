"""The hyper-parameters that may change while a job runs, and where each lives in the JobSpec.
Torch-free: the service checks edits and the dashboard lists them without the training stack.
"""

from __future__ import annotations

from typing import Any

HYPERPARAMETERS: dict[str, tuple[str, str]] = {
    "lr": ("optim", "lr"),
    "critic_lr": ("algorithm", "critic_lr"),
    "entropy_coeff": ("algorithm", "entropy_coeff"),
    "kl_loss_coef": ("algorithm", "kl_loss_coef"),
    "kl_reward_coef": ("algorithm", "kl_reward_coef"),
    "clip_ratio_low": ("algorithm", "clip_ratio_low"),
    "clip_ratio_high": ("algorithm", "clip_ratio_high"),
    "clip_ratio_c": ("algorithm", "clip_ratio_c"),
    "temperature": ("rollout", "temperature"),
    "top_p": ("rollout", "top_p"),
    "top_k": ("rollout", "top_k"),
}


def hyperparameter_overrides(changes: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Flat edits {"lr": 1e-4} as nested JobSpec overrides; an unknown name raises KeyError naming it."""
    nested: dict[str, dict[str, Any]] = {}
    for name, value in changes.items():
        if name not in HYPERPARAMETERS:
            raise KeyError(
                f"'{name}' cannot be changed while a job runs; changeable: {sorted(HYPERPARAMETERS)}"
            )
        section, field = HYPERPARAMETERS[name]
        nested.setdefault(section, {})[field] = value
    return nested
