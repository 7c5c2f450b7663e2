"""Rows whose loss has no gradient (a zero advantage everywhere) run forward only, and nothing changes.

The reference is the same batch without the `needs_backward` mark, where every row goes through
the backward: gradients, metrics, per-token outputs and the optimizer step must agree.
"""

from __future__ import annotations

import pytest
import torch

from engines.training.fsdp.engine import FSDPEngine
from schema.engine import EngineConfig, MicroBatchConfig
from tests.engine_util import full_grads, make_batch, max_rel_diff, with_zero_advantage_rows
from workers.losses import PolicyLossConfig, make_policy_loss, rows_with_gradient

SPLITS = {
    "mbs1": MicroBatchConfig(micro_batch_size=1),
    "mbs3": MicroBatchConfig(micro_batch_size=3),
    "auto": MicroBatchConfig(),
    "dynamic": MicroBatchConfig(max_tokens_per_micro_batch=24),
}


def make_engine(model_dir, split: MicroBatchConfig) -> FSDPEngine:
    engine = FSDPEngine(EngineConfig(model_path=str(model_dir), micro_batch=split, optim={"lr": 1e-2}))
    engine.initialize()
    return engine


class RowsSeen:
    """Counts the sequences the policy model runs with and without autograd (a forward pre-hook)."""

    def __init__(self, engine: FSDPEngine) -> None:
        self.with_grad = self.without_grad = 0
        engine.model.register_forward_pre_hook(self._count, with_kwargs=True)

    def _count(self, module, args, kwargs) -> None:
        sequences = len(kwargs["cu_seq_lens_q"]) - 1
        if torch.is_grad_enabled():
            self.with_grad += sequences
        else:
            self.without_grad += sequences


def run(engine: FSDPEngine, batch, steps: int = 1):
    loss_fn = make_policy_loss(PolicyLossConfig())
    with engine.train_mode():
        for _ in range(steps):
            out = engine.forward_backward_batch(batch, loss_fn, compute_entropy=True)
            grads = full_grads(engine)
            engine.optimizer_step()
    return out, grads


@pytest.mark.parametrize("split", SPLITS)
def test_rows_without_gradient_run_forward_only_and_change_nothing(tiny_model_dir, split):
    plain = make_batch(batch_size=8, seed=4)
    marked = with_zero_advantage_rows(plain, [0, 3, 4, 6])
    full_out, full = run(make_engine(tiny_model_dir, SPLITS[split]), marked.exclude("needs_backward"))
    engine = make_engine(tiny_model_dir, SPLITS[split])
    seen = RowsSeen(engine)
    out, grads = run(engine, marked)
    assert (seen.with_grad, seen.without_grad) == (4, 4)
    assert max_rel_diff(grads, full) <= 1e-5
    assert out.metrics == pytest.approx(full_out.metrics, rel=1e-5, abs=1e-7)
    for key in ("log_probs", "entropy"):  # in the batch's order, whatever ran where
        assert (out.outputs[key] - full_out.outputs[key]).abs().max() <= 1e-6


def test_a_batch_without_any_gradient_still_steps_the_optimizer(tiny_model_dir):
    """Adam moves the weights on a zero gradient (its moments remember the last steps): no row
    back-propagates, every parameter still gets its zero gradient, and the same step is taken."""
    signal = make_batch(batch_size=6, seed=1)
    silent = with_zero_advantage_rows(signal, list(range(6)))
    split = MicroBatchConfig(max_tokens_per_micro_batch=24)
    full, skipping = make_engine(tiny_model_dir, split), make_engine(tiny_model_dir, split)
    for engine in (full, skipping):
        run(engine, signal)
    run(full, silent.exclude("needs_backward"))
    seen = RowsSeen(skipping)
    _, grads = run(skipping, silent)
    assert seen.with_grad == 0 and seen.without_grad == 6
    assert all(float(g.abs().max()) == 0.0 for g in grads.values())
    after_full, after = dict(full.get_per_tensor_param()), dict(skipping.get_per_tensor_param())
    assert max(float((after[k] - after_full[k]).abs().max()) for k in after) <= 1e-7


def test_which_rows_have_a_gradient():
    batch = make_batch(batch_size=4, seed=2)
    batch["advantages"][0] = 0.0
    batch["advantages"][1] = 0.0
    batch["advantages"][1, -1] = 5.0  # only outside the response mask (row 1's last column is padding)
    assert not bool(batch["response_mask"][1, -1])
    assert rows_with_gradient(PolicyLossConfig(), batch).tolist() == [False, False, True, True]
    # An entropy bonus or a KL loss has a gradient whatever the advantage.
    assert rows_with_gradient(PolicyLossConfig(entropy_coeff=0.01), batch) is None
    assert rows_with_gradient(PolicyLossConfig(use_kl_loss=True), batch) is None
