"""Gradients accumulated over several forward_backward calls (the loss contract of engines/training/base.py):
N calls with 1/N of the batch each, told the counts of the whole batch, give the gradient of one
call with the whole batch, in every aggregation mode (two gloo ranks: tests/test_train_engine_dist.py).
And an optimizer step with AdamW settings of its own equals a step of an engine configured with them."""

from __future__ import annotations

import pytest
import torch

from engines.training.base import GlobalCounts
from engines.training.fsdp.engine import FSDPEngine
from schema.engine import EngineConfig, OptimizerConfig
from tests.engine_util import MODES, full_grads, make_batch, max_rel_diff, pg_loss

CALLS = 3  # the batch of 6 rows in calls of 2: rows of different lengths land in different calls


def _engine(model_dir, **overrides) -> FSDPEngine:
    engine = FSDPEngine(
        EngineConfig(model_path=str(model_dir), micro_batch={"micro_batch_size": 1}, **overrides)
    )
    engine.initialize()
    return engine


def _whole_and_accumulated(engine: FSDPEngine, rows, counts: GlobalCounts, mode: str, calls: int) -> tuple:
    """(grads of one call on `rows`, grads of `calls` calls on slices of them, both metric dicts)."""
    with engine.train_mode():
        whole = engine.forward_backward_batch(rows, pg_loss(mode), counts=counts)
        reference = full_grads(engine)
        engine.optimizer_zero_grad()
        step = len(rows) // calls
        metrics: dict[str, float] = {}
        for i in range(calls):
            out = engine.forward_backward_batch(rows[i * step : (i + 1) * step], pg_loss(mode), counts=counts)
            for key, value in out.metrics.items():
                metrics[key] = metrics.get(key, 0.0) + value
        accumulated = full_grads(engine)
        engine.optimizer_zero_grad()
    return reference, accumulated, whole.metrics, metrics


@pytest.fixture(scope="module")
def engine(tiny_model_dir) -> FSDPEngine:
    return _engine(tiny_model_dir)


@pytest.mark.parametrize("mode", MODES)
def test_accumulated_calls_give_the_whole_batch_gradient(engine, mode):
    batch = make_batch()
    reference, accumulated, whole, summed = _whole_and_accumulated(
        engine, batch, GlobalCounts.of([batch]), mode, CALLS
    )
    assert max_rel_diff(accumulated, reference) <= 1e-5
    assert summed["loss"] == pytest.approx(whole["loss"], rel=1e-5)
    # Without the whole batch's counts each call is normalised as a batch of its own: not the same.
    with engine.train_mode():
        for i in range(CALLS):
            engine.forward_backward_batch(batch[2 * i : 2 * i + 2], pg_loss(mode))
        own_counts = full_grads(engine)
        engine.optimizer_zero_grad()
    assert max_rel_diff(own_counts, reference) > 0.1


def test_counts_of_several_calls_are_their_sum():
    a, b = make_batch(batch_size=2, resp_len=7), make_batch(batch_size=3, resp_len=5, seed=1)
    counts = GlobalCounts.of([a, b])
    assert counts.tokens == int(a["response_mask"].sum() + b["response_mask"].sum())
    assert (counts.sequences, counts.response_width) == (5, 7)


def test_a_step_with_its_own_adam_settings_equals_a_configured_engine(tiny_model_dir):
    """optim_step(params) uses these settings for that step only; the engine's own come back after."""
    settings = {"lr": 3e-3, "betas": (0.8, 0.99), "eps": 1e-6, "weight_decay": 0.1, "grad_clip": 0.5}
    told, configured = _engine(tiny_model_dir), _engine(tiny_model_dir, optim=settings)
    norms = []
    for engine, params in ((told, OptimizerConfig(**settings)), (configured, None)):
        with engine.train_mode():
            engine.forward_backward_batch(make_batch(), pg_loss("token-mean"))
            norms.append(engine.optimizer_step(params))
    assert norms[0] == pytest.approx(norms[1], rel=1e-6)
    after = dict(told.get_per_tensor_param())
    for name, tensor in configured.get_per_tensor_param():
        assert torch.allclose(after[name], tensor, rtol=0, atol=1e-7), name
    group = told.optimizer.param_groups[0]
    assert (group["lr"], group["betas"], group["weight_decay"]) == (1e-5, (0.9, 0.999), 0.0)


def test_an_sft_update_reports_its_loss_once(tiny_model_dir):
    """sft/loss of an update equals the token-mean cross-entropy of a plain HF forward on the same
    rows (before the step), not twice it (the engine's `loss` and the SFT loss's own `sft/loss`)."""
    from transformers import AutoModelForCausalLM

    from schema.losses import SFTLossConfig
    from schema.workers import UpdateSchedule
    from tests.engine_util import reference_log_probs
    from workers.batch import Batch
    from workers.operations import train_on_batch

    rows = make_batch(seed=3)
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    with torch.no_grad():
        nll = -reference_log_probs(model, rows)
    expected = float(nll.sum() / rows["response_mask"].sum())
    schedule = UpdateSchedule(mini_batch_size=None, epochs=1, shuffle=False, seed=0)
    metrics = train_on_batch(
        _engine(tiny_model_dir), Batch(rows), SFTLossConfig(loss_agg_mode="token-mean"), schedule, "sft"
    )
    assert metrics["sft/loss"] == pytest.approx(expected, rel=1e-5)
