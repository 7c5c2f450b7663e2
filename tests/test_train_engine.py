"""The FSDP2 training engine on CPU: gradient invariance, packing, optimisation, checkpoints, weights out.

References are computed another way: an unsharded Hugging Face model run on the padded batch.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from engines.training import checkpoint_paths
from engines.training.base import SCORED
from engines.training.fsdp import state as ckpt
from engines.training.fsdp.engine import FSDPEngine
from engines.training.fsdp.modules import ModelLoadError
from engines.training.microbatch import TOKEN_BUDGET_SCALE, MicroBatchError, auto_token_budget
from schema.engine import EngineConfig, MicroBatchConfig
from tests.engine_util import (
    MODES,
    full_grads,
    make_batch,
    max_rel_diff,
    pg_loss,
    reference_log_probs,
    reference_loss,
)

SPLITS = {
    "mbs1": MicroBatchConfig(micro_batch_size=1),
    "mbs2": MicroBatchConfig(micro_batch_size=2),
    "auto": MicroBatchConfig(),  # the auto token budget: the whole batch for this tiny model
    "dynamic": MicroBatchConfig(max_tokens_per_micro_batch=24),
}


def make_engine(model_dir, **overrides) -> FSDPEngine:
    engine = FSDPEngine(EngineConfig(model_path=str(model_dir), **overrides))
    engine.initialize()
    return engine


@pytest.fixture(scope="module")
def hf_reference(tiny_model_dir):
    return AutoModelForCausalLM.from_pretrained(
        tiny_model_dir, dtype=torch.float32, attn_implementation="sdpa"
    )


def reference_grads(model, batch, mode) -> tuple[float, dict[str, torch.Tensor]]:
    model = copy.deepcopy(model)
    loss = reference_loss(model, batch, mode)
    loss.backward()
    return float(loss.detach()), {n: p.grad.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("mode", MODES)
def test_gradients_do_not_depend_on_the_micro_batch_split(tiny_model_dir, hf_reference, mode):
    batch = make_batch()
    ref_loss, ref = reference_grads(hf_reference, batch, mode)
    for split_name, split in SPLITS.items():
        engine = make_engine(tiny_model_dir, micro_batch=split)
        with engine.train_mode():
            out = engine.forward_backward_batch(batch, pg_loss(mode))
            grads = full_grads(engine)
        assert max_rel_diff(grads, ref) <= 1e-5, f"{mode}/{split_name}"
        # The logged loss is the whole-batch loss, whatever the split.
        assert out.metrics["loss"] == pytest.approx(ref_loss, rel=1e-5, abs=1e-7), f"{mode}/{split_name}"
        assert out.metrics["pg_loss"] == pytest.approx(ref_loss, rel=1e-5, abs=1e-7)


def test_rows_not_scored_leave_the_loss_and_its_sequence_count(tiny_model_dir, hf_reference):
    """Rows whose reward failed (SCORED False, response mask 0, as controller/step_math.py leaves
    them) add nothing and are not counted: the loss and gradients are those of the scored rows alone,
    in every aggregation mode (token-mean by the mask; the seq-mean modes by N_seqs)."""
    batch, failed, scored_rows = make_batch(), [1, 4], [0, 2, 3, 5]
    batch[SCORED] = torch.ones(len(batch), dtype=torch.bool)
    batch[SCORED][failed] = False
    batch["response_mask"][failed] = 0
    alone = batch[torch.tensor(scored_rows)].exclude(SCORED)
    engine = make_engine(tiny_model_dir, micro_batch=SPLITS["mbs2"])
    for mode in MODES:
        ref_loss, ref = reference_grads(hf_reference, alone, mode)
        with engine.train_mode():
            engine.optimizer_zero_grad()
            out = engine.forward_backward_batch(batch, pg_loss(mode))
            grads = full_grads(engine)
        assert out.metrics["loss"] == pytest.approx(ref_loss, rel=1e-5, abs=1e-7), mode
        assert max_rel_diff(grads, ref) <= 1e-5, mode


def test_dynamic_batching_respects_the_budget_and_keeps_order(tiny_model_dir, hf_reference):
    batch = make_batch(batch_size=8)
    engine = make_engine(tiny_model_dir, micro_batch=MicroBatchConfig(max_tokens_per_micro_batch=20))
    lengths = batch["attention_mask"].sum(1).tolist()
    plan = engine.planner.plan(lengths)
    assert len(plan) > 1 and all(sum(lengths[i] for i in mb) <= 20 for mb in plan)
    assert sorted(i for mb in plan for i in mb) == list(range(8))
    with engine.eval_mode():
        out = engine.forward_backward_batch(batch, None, forward_only=True)
    with torch.no_grad():
        ref = reference_log_probs(hf_reference, batch)
    assert (out.outputs["log_probs"] - ref).abs().max() <= 1e-5


def test_without_a_split_the_budget_comes_from_model_size(tiny_model_dir, monkeypatch):
    assert auto_token_budget(512, "cpu") == 2048 and auto_token_budget(1024, "cpu") == 1024
    assert auto_token_budget(64, "cuda") > auto_token_budget(64, "cpu")
    engine = make_engine(tiny_model_dir)  # no micro_batch settings
    lengths = make_batch(batch_size=8)["attention_mask"].sum(1).tolist()
    assert engine.planner.plan(lengths) == [list(range(8))]  # hidden 64: the whole batch fits the budget
    monkeypatch.setitem(TOKEN_BUDGET_SCALE, "cpu", 20 * 64)  # as if the model were 13x wider
    plan = engine.planner.plan(lengths)
    assert len(plan) > 1 and all(sum(lengths[i] for i in mb) <= 20 for mb in plan)
    assert sorted(i for mb in plan for i in mb) == list(range(8))
    monkeypatch.setitem(TOKEN_BUDGET_SCALE, "cpu", 1)  # never below the longest sequence
    plan = engine.planner.plan(lengths)
    assert max(sum(lengths[i] for i in mb) for mb in plan) == max(lengths) and len(plan) > 2


def test_packed_log_probs_equal_a_padded_forward(tiny_model_dir, hf_reference):
    batch = make_batch(batch_size=5, seed=3)
    engine = make_engine(tiny_model_dir)
    with engine.eval_mode():
        out = engine.forward_backward_batch(batch, None, forward_only=True, compute_entropy=True)
    with torch.no_grad():
        ref = reference_log_probs(hf_reference, batch)
    assert (out.outputs["log_probs"] - ref).abs().max() <= 1e-5
    # Packed sequences are isolated: the same row alone gives the same log-probs.
    with engine.eval_mode():
        alone = engine.forward_backward_batch(batch[2:3], None, forward_only=True)
    assert (alone.outputs["log_probs"][0] - out.outputs["log_probs"][2]).abs().max() <= 1e-5
    entropy = out.outputs["entropy"]
    assert entropy.shape == ref.shape and (entropy[batch["response_mask"].bool()] > 0).all()


def test_chunked_log_probs_match_unchunked(tiny_model_dir):
    batch = make_batch(seed=5)
    a = make_engine(tiny_model_dir, logprob_chunk_tokens=7)
    b = make_engine(tiny_model_dir, logprob_chunk_tokens=4096)
    with a.eval_mode(), b.eval_mode():
        la = a.forward_backward_batch(batch, None, forward_only=True).outputs["log_probs"]
        lb = b.forward_backward_batch(batch, None, forward_only=True).outputs["log_probs"]
    assert (la - lb).abs().max() <= 1e-6


def test_temperature_scales_the_logits(tiny_model_dir, hf_reference):
    batch = make_batch(seed=2)
    engine = make_engine(tiny_model_dir)
    with engine.eval_mode():
        out = engine.forward_backward_batch(batch, None, forward_only=True, temperature=0.7)
    ids, mask = batch["input_ids"], batch["attention_mask"]
    with torch.no_grad():
        logits = hf_reference(
            input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(1) - 1).clamp(min=0)
        ).logits
        lp = torch.log_softmax(logits[:, :-1] / 0.7, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    ref = lp[:, -7:] * batch["response_mask"]
    assert (out.outputs["log_probs"] - ref).abs().max() <= 1e-5


def test_optimizer_steps_reduce_the_loss_and_report_the_true_grad_norm(tiny_model_dir, hf_reference):
    batch = make_batch()
    engine = make_engine(tiny_model_dir, optim={"lr": 1e-2, "grad_clip": 0.5})
    _, ref = reference_grads(hf_reference, batch, "token-mean")
    expected_norm = float(torch.nn.utils.get_total_norm(list(ref.values())))
    losses = []
    with engine.train_mode():
        for step in range(4):
            losses.append(engine.forward_backward_batch(batch, pg_loss("token-mean")).metrics["loss"])
            norm = engine.optimizer_step()
            if step == 0:
                assert norm == pytest.approx(expected_norm, rel=1e-5)
            assert engine.lr_scheduler_step() == pytest.approx(1e-2)
    assert losses[-1] < losses[0] - 0.1, losses


def test_non_finite_gradients_skip_the_update(tiny_model_dir):
    batch = make_batch()
    engine = make_engine(tiny_model_dir)
    before = {n: t.clone() for n, t in engine.get_per_tensor_param()}

    def nan_loss(micro, outputs, counts):
        return outputs["log_probs"].sum() * float("nan"), {}

    with engine.train_mode():
        engine.forward_backward_batch(batch, nan_loss)
        assert math.isnan(engine.optimizer_step())
    assert engine.skipped_steps == 1
    after = dict(engine.get_per_tensor_param())
    assert all(torch.equal(before[n], after[n]) for n in before)


def test_cosine_schedule_with_warmup(tiny_model_dir):
    sched = {"kind": "cosine", "warmup_steps": 2, "total_steps": 10, "min_lr_ratio": 0.1}
    engine = make_engine(tiny_model_dir, optim={"lr": 1.0}, scheduler=sched)
    lrs = [engine.learning_rate] + [engine.lr_scheduler_step() for _ in range(10)]
    assert lrs[:3] == pytest.approx([1 / 3, 2 / 3, 1.0])
    assert lrs[6] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 4 / 8)))
    assert lrs[10] == pytest.approx(0.1)


def test_per_tensor_params_rebuild_the_model(tiny_model_dir, tmp_path):
    batch = make_batch()
    engine = make_engine(tiny_model_dir, optim={"lr": 1e-2})
    with engine.train_mode():
        engine.forward_backward_batch(batch, pg_loss("token-mean"))
        engine.optimizer_step()
    fresh = AutoModelForCausalLM.from_pretrained(
        tiny_model_dir, dtype=torch.float32, attn_implementation="sdpa"
    )
    streamed = dict(engine.get_per_tensor_param())
    assert set(streamed) == set(fresh.state_dict())
    fresh.load_state_dict(streamed)
    with engine.eval_mode():
        mine = engine.forward_backward_batch(batch, None, forward_only=True).outputs["log_probs"]
    with torch.no_grad():
        theirs = reference_log_probs(fresh, batch)
    assert (mine - theirs).abs().max() <= 1e-5
    # And the HF export loads through from_pretrained with the same weights.
    engine.export_hf(str(tmp_path / "export"))
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "export", dtype=torch.float32)
    assert all(torch.equal(exported.state_dict()[k], streamed[k]) for k in streamed)
    assert (tmp_path / "export" / "tokenizer.json").exists()


def _train(engine, batch, steps):
    with engine.train_mode():
        for _ in range(steps):
            engine.forward_backward_batch(batch, pg_loss("token-mean"))
            engine.optimizer_step()
            engine.lr_scheduler_step()


def _optimizer_tensors(engine):
    out = {}
    for i, state in enumerate(engine.optimizer.state.values()):
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                out[f"{i}.{key}"] = value.full_tensor() if hasattr(value, "full_tensor") else value.clone()
    return out


def test_checkpoint_resume_is_bitwise_and_saves_are_atomic(tiny_model_dir, tmp_path, monkeypatch):
    batch = make_batch()
    sched = {"kind": "cosine", "warmup_steps": 1, "total_steps": 8}
    engine = make_engine(tiny_model_dir, optim={"lr": 1e-2}, scheduler=sched)
    _train(engine, batch, 3)
    path = tmp_path / "step_3"
    engine.save_checkpoint(str(path), step=3)
    _train(engine, batch, 2)
    expected_params, expected_optim = dict(engine.get_per_tensor_param()), _optimizer_tensors(engine)

    resumed = make_engine(tiny_model_dir, optim={"lr": 1e-2}, scheduler=sched)
    assert resumed.load_checkpoint(str(path)) == 3
    _train(resumed, batch, 2)
    got_params, got_optim = dict(resumed.get_per_tensor_param()), _optimizer_tensors(resumed)
    assert all(torch.equal(got_params[k], expected_params[k]) for k in expected_params)
    assert got_optim.keys() == expected_optim.keys()
    assert all(torch.equal(got_optim[k], expected_optim[k]) for k in expected_optim)
    assert resumed.learning_rate == engine.learning_rate

    # A save that dies half-way leaves the previous checkpoint in place and loadable.
    def crash(*args, **kwargs):
        raise OSError("disk full (injected)")

    monkeypatch.setattr("engines.training.fsdp.state.dcp.save", crash)
    with pytest.raises(OSError, match="injected"):
        engine.save_checkpoint(str(path), step=5)
    monkeypatch.undo()
    assert make_engine(tiny_model_dir).load_checkpoint(str(path)) == 3
    # A crash between the two renames of the swap: only <path>.old is left, and it is found.
    path.rename(path.with_name("step_3.old"))
    assert ckpt.resolve_checkpoint(path).name == "step_3.old"
    assert make_engine(tiny_model_dir).load_checkpoint(str(path)) == 3


def test_checkpoint_folders_are_listed_oldest_first(tmp_path):
    for step in (30, 1, 12):
        checkpoint_paths.step_dir(tmp_path, step).mkdir()
    (tmp_path / "step_x").mkdir()
    listed = checkpoint_paths.list_checkpoints(tmp_path)
    assert [(s, p.name) for s, p in listed] == [
        (1, "step_00000001"),
        (12, "step_00000012"),
        (30, "step_00000030"),
    ]
    assert checkpoint_paths.list_checkpoints(tmp_path / "absent") == []


def test_offload_runs_the_same_path_and_gives_the_same_result(tiny_model_dir):
    batch = make_batch()
    plain = make_engine(tiny_model_dir, optim={"lr": 1e-2})
    offloaded = make_engine(
        tiny_model_dir, optim={"lr": 1e-2}, fsdp={"param_offload": True, "optimizer_offload": True}
    )
    _train(plain, batch, 2)
    _train(offloaded, batch, 2)
    assert offloaded._offloaded == {"model": True, "optimizer": True}
    with pytest.raises(RuntimeError, match="offloaded"):
        next(offloaded.get_per_tensor_param())
    with offloaded.eval_mode():
        got = dict(offloaded.get_per_tensor_param())
    want = dict(plain.get_per_tensor_param())
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_value_model_trains_towards_its_targets(tiny_model_dir):
    batch = make_batch()
    engine = make_engine(tiny_model_dir, role="value", optim={"lr": 1e-2})
    target = torch.full_like(batch["advantages"], 0.5)

    def value_loss(micro, outputs, counts):
        err = (outputs["values"] - 0.5) ** 2 * micro["response_mask"]
        return err.sum() / counts.tokens, {}

    losses = []
    with engine.train_mode():
        for _ in range(5):
            out = engine.forward_backward_batch(batch, value_loss)
            losses.append(out.metrics["loss"])
            engine.optimizer_step()
    assert out.outputs["values"].shape == target.shape
    assert losses[-1] < losses[0] * 0.5, losses


def test_reference_engine_is_forward_only(tiny_model_dir):
    engine = make_engine(tiny_model_dir, trainable=False)
    assert engine.optimizer is None
    with pytest.raises(ValueError, match="forward_only"):
        engine.forward_backward_batch(make_batch(), pg_loss("token-mean"))


def test_configuration_errors_are_specific(tiny_model_dir, tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        make_engine(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelLoadError, match="no config.json"):
        make_engine(tmp_path / "empty")
    with pytest.raises(ValueError, match="exclusive"):
        MicroBatchConfig(micro_batch_size=2, max_tokens_per_micro_batch=100)
    with pytest.raises(ValueError, match="no optimizer"):
        EngineConfig(model_path=str(tiny_model_dir), trainable=False, fsdp={"optimizer_offload": True})
    engine = make_engine(tiny_model_dir, micro_batch=MicroBatchConfig(max_tokens_per_micro_batch=4))
    with pytest.raises(MicroBatchError, match="smaller than the longest sequence"):
        with engine.eval_mode():
            engine.forward_backward_batch(make_batch(), None, forward_only=True)


def test_bf16_on_one_cpu_rank_keeps_fp32_weights_and_multiplies_in_bf16(tiny_model_dir):
    """dtype bfloat16 on one CPU rank (engines/training/fsdp/engine.py): not FSDP-wrapped, fp32 weights and
    Adam state, the forward under autocast. Checked against the fp32 engine: log-probs within bf16's
    error (and not equal to them: the products did run in bf16), gradients pointing the same way;
    and one step moves the weights as the fp32 engine's step does. (Sharded bf16 keeping layers
    gathered across micro-batches: tests/test_train_engine_dist.py.)"""
    batch = make_batch()
    engines = {}
    for dtype in ("float32", "bfloat16"):
        engines[dtype] = make_engine(tiny_model_dir, dtype=dtype, micro_batch={"micro_batch_size": 2},
                                     optim={"lr": 1e-3})  # fmt: skip
    bf16, fp32 = engines["bfloat16"], engines["float32"]
    assert (bf16.sharded, bf16.autocast_dtype, fp32.autocast_dtype) == (False, torch.bfloat16, None)
    assert {p.dtype for p in bf16.model.parameters()} == {torch.float32}
    outs, grads, params = {}, {}, {}
    for dtype, engine in engines.items():
        with engine.train_mode():
            outs[dtype] = engine.forward_backward_batch(batch, pg_loss("token-mean"), compute_entropy=True)
            grads[dtype] = full_grads(engine)
            engine.optimizer_step()
        params[dtype] = dict(engine.get_per_tensor_param())
    assert {s.dtype for s in bf16.optimizer.state_dict()["state"][0].values() if s.dim()} == {torch.float32}
    mask = batch["response_mask"].bool()
    # Measured: 2.2e-3 and 2.6e-5; gradient cosines >= 0.99993, the steps' 0.996.
    for key, tolerance in (("log_probs", 0.02), ("entropy", 0.01)):
        diff = (outs["bfloat16"].outputs[key] - outs["float32"].outputs[key])[mask].abs()
        assert 0 < float(diff.max()) <= tolerance, (key, float(diff.max()))
    cosines = [
        float(F.cosine_similarity(grads["bfloat16"][k].flatten(), grads["float32"][k].flatten(), dim=0))
        for k in grads["float32"]
        if grads["float32"][k].norm() > 0
    ]
    assert min(cosines) > 0.999, min(cosines)
    start = dict(make_engine(tiny_model_dir).get_per_tensor_param())
    steps = {d: torch.cat([(params[d][k] - start[k]).flatten() for k in start]) for d in params}
    step_cosine = float(F.cosine_similarity(steps["bfloat16"], steps["float32"], dim=0))
    assert step_cosine > 0.98, step_cosine  # Adam's first step is ~lr * sign(g): near-zero g may flip


def test_under_cpu_autocast_attention_and_the_log_prob_head_stay_fp32():
    """The two pieces bf16 on a CPU leaves in fp32: the log-prob head (bf16 logits would round
    log-probs by up to ~0.06) and the segment attention (the CPU's bf16 SDPA is slow). Under autocast
    each gives exactly what it gives outside it, from the same inputs."""
    from engines.kernels.attention import segment_attention
    from engines.kernels.logprobs import token_log_probs

    g = torch.Generator().manual_seed(0)
    hidden, weight = torch.randn(10, 16, generator=g), torch.randn(50, 16, generator=g)
    targets = torch.randint(0, 50, (10,), generator=g)
    want = token_log_probs(hidden, weight, targets, with_entropy=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = token_log_probs(hidden, weight, targets, with_entropy=True)
    assert got[0].dtype == torch.float32 and torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])

    q, k, v = (torch.randn(1, 2, 9, 8, generator=g).bfloat16() for _ in range(3))
    bounds = torch.tensor([0, 4, 9])
    module = torch.nn.Module()
    want, _ = segment_attention(module, q.float(), k.float(), v.float(), None, cu_seq_lens_q=bounds)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got, _ = segment_attention(module, q, k, v, None, cu_seq_lens_q=bounds)
    assert got.dtype == torch.float32 and torch.equal(got, want)


def test_gradient_checkpointing_recomputes_each_layer_in_backward_with_the_same_gradients(tiny_model_dir):
    """model.gradient_checkpointing: each decoder layer's forward runs again in the backward pass
    (its activations were not kept), and the gradients are the plain engine's."""
    batch = make_batch()
    grads, calls = {}, {}
    for checkpointed in (False, True):
        engine = make_engine(tiny_model_dir, gradient_checkpointing=checkpointed)
        layers = [m for n, m in engine.model.named_modules() if type(m).__name__.endswith("DecoderLayer")]
        runs: list[int] = []
        for layer in layers:
            layer.register_forward_pre_hook(lambda *_, runs=runs: runs.append(1))
        with engine.train_mode():
            engine.forward_backward_batch(batch, pg_loss("token-mean"))
            grads[checkpointed] = full_grads(engine)
        calls[checkpointed] = len(runs) / len(layers)
    assert calls[True] == 2 * calls[False] > 0, calls
    assert max_rel_diff(grads[True], grads[False]) <= 1e-5
