"""A tied input embedding (SmolLM2's) on one CPU rank: its gradient arrives sparse and is summed into
the head's dense one (engines/training/fsdp/modules.sparse_tied_embedding). Checked against an unsharded
Hugging Face model's dense gradients, over one and several micro-batches, and through a step."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from engines.models.tiny_models import TinyModelSpec, build_tiny_model
from engines.training.fsdp.engine import FSDPEngine
from schema.engine import EngineConfig, MicroBatchConfig
from tests.engine_util import full_grads, make_batch, max_rel_diff, pg_loss, reference_loss


@pytest.fixture(scope="module")
def tied_model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tied"), TinyModelSpec(tie_word_embeddings=True))


def make_engine(model_dir, **overrides) -> FSDPEngine:
    engine = FSDPEngine(EngineConfig(model_path=str(model_dir), **overrides))
    engine.initialize()
    return engine


@pytest.mark.parametrize("split", [MicroBatchConfig(), MicroBatchConfig(micro_batch_size=2)])
def test_tied_gradient_equals_the_dense_reference(tied_model_dir, split):
    batch = make_batch()
    reference = AutoModelForCausalLM.from_pretrained(tied_model_dir, dtype=torch.float32)
    assert reference.get_input_embeddings().weight is reference.get_output_embeddings().weight
    reference_loss(reference, batch, "token-mean").backward()
    want = {n: p.grad for n, p in reference.named_parameters()}
    engine = make_engine(tied_model_dir, micro_batch=split)
    lm = engine.model.lm
    assert lm.get_input_embeddings().sparse  # the path under test is the one taken
    with engine.train_mode():
        engine.forward_backward_batch(batch, pg_loss("token-mean"))
        grads = full_grads(engine)
    weight = lm.get_input_embeddings().weight
    assert weight.grad.layout == torch.strided  # dense: what clipping and fused AdamW take
    assert max_rel_diff(grads, want) <= 1e-5


def test_a_sparse_gradient_left_alone_is_made_dense_for_the_step(tied_model_dir):
    """Were a loss to read no head, the tied weight's gradient would stay sparse: the step densifies
    it, clips it with the rest and moves exactly the rows it names."""
    engine = make_engine(tied_model_dir, optim={"lr": 1e-2, "weight_decay": 0.0})
    weight = engine.model.lm.get_input_embeddings().weight
    before = weight.detach().clone()
    rows = torch.tensor([3, 7])
    with engine.train_mode():
        embedded = torch.nn.functional.embedding(rows, weight, sparse=True)
        embedded.sum().backward()
        assert weight.grad.is_sparse
        norm = engine.optimizer_step()
    assert norm == pytest.approx(float(2 * weight.shape[1]) ** 0.5, rel=1e-6)
    moved = (weight.detach() != before).any(1).nonzero().flatten()
    assert moved.tolist() == rows.tolist()
