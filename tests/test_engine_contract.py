"""The training-engine contract (engines/training/base.py) checked the same way over the FSDP engine (an RL
job's own weights) and the adapter engine (one adapter of a Tinker host's base), both driven through
the same operations (`workers.operations.TrainOps`, the adapter key None for the FSDP engine).

References are computed another way: a plain Hugging Face forward of the padded batch, one call with
the whole batch for accumulated calls, the weights before a step for save/load.
"""

from __future__ import annotations

import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from engines.training.base import GlobalCounts
from schema.engine import OptimizerConfig
from tests.engine_util import full_grads, make_batch, max_rel_diff, pg_loss, reference_log_probs
from workers.operations import TrainOps

LR = 1e-2


class Driven:
    """One engine behind TrainOps, with what the checks read: its trainable weights and gradients."""

    def __init__(self, engine, adapter: str | None) -> None:
        self.engine, self.adapter, self.ops = engine, adapter, TrainOps(engine)

    def weights(self) -> dict[str, torch.Tensor]:
        if self.adapter is None:
            return {k: v.clone() for k, v in self.engine.get_per_tensor_param()}
        return {str(i): p.detach().clone() for i, p in enumerate(self.engine.sessions[self.adapter].params())}

    def grads(self) -> dict[str, torch.Tensor]:
        if self.adapter is None:
            return full_grads(self.engine)
        params = self.engine.sessions[self.adapter].params()
        return {str(i): p.grad.clone() for i, p in enumerate(params) if p.grad is not None}

    def zero_grad(self) -> None:
        self.engine.optimizer_zero_grad(**({} if self.adapter is None else {"adapter": self.adapter}))


@pytest.fixture(params=["fsdp", "adapter"])
def driven(request, tiny_model_dir, tmp_path) -> Driven:
    if request.param == "fsdp":
        from engines.training.fsdp.engine import FSDPEngine
        from schema.engine import EngineConfig

        engine = FSDPEngine(EngineConfig(model_path=str(tiny_model_dir), optim={"lr": LR}))
        engine.initialize()
        return Driven(engine, None)
    from engines.training.adapter_engine import AdapterEngine, EngineOptions

    engine = AdapterEngine(str(tiny_model_dir), tmp_path / "host", EngineOptions())
    engine.create_adapter("a", engine.adapter_spec(4, 1, True, True, True))
    # B starts at zero (the adapter starts as the base): one step makes it a real adapter
    driven = Driven(engine, "a")
    driven.ops.forward_backward(make_batch(seed=9), pg_loss("token-mean"), adapter="a")
    driven.ops.optim_step(OptimizerConfig(lr=LR), adapter="a")
    return driven


@pytest.fixture(scope="module")
def hf_base(tiny_model_dir):
    return AutoModelForCausalLM.from_pretrained(
        tiny_model_dir, dtype=torch.float32, attn_implementation="sdpa"
    )


def test_forward_gives_the_response_log_probs_of_a_padded_forward(driven, hf_base):
    batch = make_batch(batch_size=5, seed=3)
    with driven.engine.eval_mode():
        got = driven.ops.forward(batch, adapter=driven.adapter)["log_probs"]
    mask = batch["response_mask"]
    assert got.shape == mask.shape
    if driven.adapter is None:  # the engine's own weights are the base's
        with torch.no_grad():
            assert ((got - reference_log_probs(hf_base, batch)) * mask).abs().max() <= 1e-5
    # rows are isolated: a row alone gives its log-probs in the batch
    with driven.engine.eval_mode():
        alone = driven.ops.forward(batch[2:3], adapter=driven.adapter)["log_probs"]
    assert ((alone[0] - got[2]) * mask[2]).abs().max() <= 1e-5


def test_calls_with_the_whole_batch_counts_accumulate_to_one_call(driven):
    batch, loss = make_batch(), pg_loss("token-mean")
    with driven.engine.train_mode():
        driven.ops.forward_backward(batch, loss, adapter=driven.adapter)
        whole = driven.grads()
        driven.zero_grad()
        counts = GlobalCounts.of([batch])
        driven.ops.forward_backward(batch[:2], loss, counts, adapter=driven.adapter)
        driven.ops.forward_backward(batch[2:], loss, counts, adapter=driven.adapter)
        split = driven.grads()
    assert whole and max_rel_diff(split, whole) <= 1e-5


def test_a_step_moves_the_weights_zeroes_the_gradients_and_save_load_restores_them(driven, tmp_path):
    batch, loss = make_batch(), pg_loss("token-mean")
    path = str(tmp_path / "state")
    driven.ops.save_state(path, 0, adapter=driven.adapter)
    saved = driven.weights()
    with driven.engine.train_mode():
        driven.ops.forward_backward(batch, loss, adapter=driven.adapter)
        norm = driven.ops.optim_step(OptimizerConfig(lr=LR), adapter=driven.adapter)
    assert math.isfinite(norm) and norm > 0
    assert not driven.grads()  # zeroed by the step
    assert any(not torch.equal(saved[k], v) for k, v in driven.weights().items())
    driven.ops.load_state(path, adapter=driven.adapter)
    assert all(torch.equal(saved[k], v) for k, v in driven.weights().items())
