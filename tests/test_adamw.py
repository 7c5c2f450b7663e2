"""Tandem's one AdamW (engines/training/adamw.py), as an RL engine's OptimizerConfig and a Tinker session's
AdamParams reach it: the SDK's defaults, one step the same through both, and a non-finite gradient
skipping a session's step as it skips an engine's (tests/test_train_engine.py)."""

from __future__ import annotations

import math

import pytest
import torch

from engines.training.adamw import AdamWSettings, adamw_step, build_adamw
from engines.training.lora_sessions import Session, SessionSpec
from schema.engine import OptimizerConfig

# every setting off its default, so that a mapping that drops one shows
ADAM = {
    "learning_rate": 0.05,
    "beta1": 0.7,
    "beta2": 0.99,
    "eps": 1e-6,
    "weight_decay": 0.01,
    "grad_clip_norm": 1.0,
}
SPEC = SessionSpec(rank=2, alpha=4.0, seed=0, paths=("layer.0", "layer.1"))


def session() -> Session:
    g = torch.Generator().manual_seed(0)
    weights = {
        path: (
            torch.randn(2, 6, generator=g).requires_grad_(),
            torch.randn(5, 2, generator=g).requires_grad_(),
        )
        for path in SPEC.paths
    }
    return Session("s", SPEC, weights, torch.device("cpu"))


def set_grads(params: list[torch.Tensor], seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g)


def test_sdk_defaults_are_the_official_adam_params():
    tinker = pytest.importorskip("tinker")
    sdk = tinker.AdamParams()
    assert AdamWSettings.from_adam_params({}) == AdamWSettings(
        lr=sdk.learning_rate,
        betas=(sdk.beta1, sdk.beta2),
        eps=sdk.eps,
        weight_decay=sdk.weight_decay,
        grad_clip=None,  # the SDK's grad_clip_norm 0 means no clipping
    )


def test_a_session_and_an_engine_config_take_the_same_step():
    s = session()
    engine_params = [p.detach().clone().requires_grad_() for p in s.params()]
    initial = [p.detach().clone() for p in engine_params]
    config = OptimizerConfig(lr=0.05, betas=(0.7, 0.99), eps=1e-6, weight_decay=0.01, grad_clip=1.0)
    assert AdamWSettings.of(config) == AdamWSettings.from_adam_params(ADAM)
    optimizer = build_adamw(engine_params, AdamWSettings.of(config))
    for seed in range(3):
        set_grads(s.params(), seed)
        set_grads(engine_params, seed)
        mine = s.optim_step(AdamWSettings.from_adam_params(ADAM))
        norm = adamw_step(optimizer, engine_params, AdamWSettings.of(config))
        assert mine == norm and norm > 1.0  # clipped
    for mine, theirs, start in zip(s.params(), engine_params, initial, strict=True):
        assert torch.equal(mine, theirs) and not torch.equal(mine, start)
        assert mine.grad is None  # zeroed by the step


def test_a_non_finite_gradient_skips_a_sessions_step():
    s = session()
    set_grads(s.params(), 0)
    s.optim_step(AdamWSettings.from_adam_params(ADAM))
    before = [p.detach().clone() for p in s.params()]
    state = {k: v.clone() for k, v in s.optimizer.state[s.params()[0]].items()}
    set_grads(s.params(), 1)
    s.params()[1].grad[0, 0] = float("nan")
    assert math.isnan(s.optim_step(AdamWSettings.from_adam_params(ADAM)))
    assert all(torch.equal(a, b) for a, b in zip(s.params(), before, strict=True))
    assert all(torch.equal(v, s.optimizer.state[s.params()[0]][k]) for k, v in state.items())
    assert all(p.grad is None for p in s.params())
