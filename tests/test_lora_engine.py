"""LoRA on the FSDP engine (CPU, fp32): what trains, the reference without a second model, the
adapter's export, checkpoints, and the adapter sync into the hf rollout engine.

References are computed another way: PEFT's own `PeftModel` over the plain Hugging Face model (the
exported adapter), the plain base model for the reference policy, and an uninterrupted run for
resume. Tolerances: the same fp32 arithmetic in another order agrees to ~1e-6; 1e-5 is asserted
for the trainer against PEFT, 1e-4 for a rollout engine against the trainer (the issue's bound).
"""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader
from transformers import AutoModelForCausalLM

from engines.rollout.base import SamplingParams
from engines.rollout.hf import HFRolloutEngine
from engines.training.fsdp.engine import FSDPEngine
from engines.transfer.adapter import AdapterSyncError, AdapterTransfer
from schema.engine import EngineConfig
from tests.engine_util import make_batch, pg_loss, reference_log_probs

LORA = {"rank": 4, "alpha": 8.0}


def make_engine(model_dir, **overrides) -> FSDPEngine:
    config = {"model_path": str(model_dir), "lora": LORA, "optim": {"lr": 2e-2}, **overrides}
    engine = FSDPEngine(EngineConfig(**config))
    engine.initialize()
    return engine


def train_steps(engine: FSDPEngine, steps: int, seed: int = 0) -> None:
    with engine.train_mode():
        for step in range(steps):
            engine.forward_backward_batch(make_batch(seed=seed + step), pg_loss("token-mean"))
            engine.optimizer_step()


def log_probs(engine: FSDPEngine, batch) -> torch.Tensor:
    with engine.eval_mode():
        return engine.forward_backward_batch(batch, None, forward_only=True).outputs["log_probs"]


@pytest.fixture(scope="module")
def trained(tiny_model_dir):
    """A LoRA engine after three updates (B is no longer zero: the adapter changes the policy)."""
    engine = make_engine(tiny_model_dir)
    train_steps(engine, 3)
    return engine


def test_the_optimizer_holds_exactly_the_adapters_and_the_base_gets_no_gradient(tiny_model_dir):
    engine = make_engine(tiny_model_dir)
    in_optimizer = {id(p) for group in engine.optimizer.param_groups for p in group["params"]}
    adapters = {id(p) for n, p in engine.model.named_parameters() if ".lora_A." in n or ".lora_B." in n}
    assert in_optimizer == adapters and len(adapters) == 2 * 7 * 2  # A and B, 7 layers each, 2 blocks
    with engine.train_mode():
        engine.forward_backward_batch(make_batch(), pg_loss("token-mean"))
        with_grad = {id(p) for p in engine.model.parameters() if p.grad is not None}
    assert with_grad == adapters
    assert all(not p.requires_grad for n, p in engine.model.named_parameters() if "lora_" not in n)


def test_an_adapter_on_the_output_projection_is_refused_not_silently_untrained(tiny_model_dir):
    """The log-probs read the output projection's weight directly, so its adapter would get no
    gradient; the service refuses the name at submission, the engine refuses it too."""
    from engines.training.fsdp.lora import attach
    from schema.engine import LoraConfig

    lm = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    with pytest.raises(ValueError, match="output projection"):
        attach(lm, LoraConfig(rank=4, target_modules=["q_proj", "lm_head"]))
    with pytest.raises(ValueError, match="target_modules: no linear layer of this model is named"):
        attach(lm, LoraConfig(rank=4, target_modules=["qkv_proj"]))


def test_the_reference_is_the_base_model_with_adapters_off(tiny_model_dir, trained):
    batch = make_batch(seed=7)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = reference_log_probs(base, batch)
    with trained.eval_mode(), trained.adapters_off():
        reference = trained.forward_backward_batch(batch, None, forward_only=True).outputs["log_probs"]
    assert torch.allclose(reference, expected, atol=1e-5)
    assert (log_probs(trained, batch) - expected).abs().max() > 1e-3  # the adapters are back on


def test_the_jobs_adapter_in_the_layers_session_table_gives_its_log_probs(trained):
    """One LoRA layer: a job trains its adapter in the layers Tinker sessions use (engines/training/multi_lora.py).
    Put in their table as a session's adapter is, chosen by row, the job's adapter computes what the
    layers' own adapter computes (the same arithmetic: 1e-6)."""
    from engines.training.multi_lora import MultiLoraLinear, attach, detach, rows

    layers = {n: m for n, m in trained.model.named_modules() if isinstance(m, MultiLoraLinear)}
    weights = {n: (m.lora_A.weight.detach(), m.lora_B.weight.detach()) for n, m in layers.items()}
    batch = make_batch(seed=13)
    own = log_probs(trained, batch)
    with trained.adapters_off():
        base = log_probs(trained, batch)
    attach(layers, "session", weights, LORA["alpha"] / LORA["rank"])
    try:
        # the engine packs each micro-batch into one row, so one segment covers it
        with trained.adapters_off(), rows(layers, [("session", 1)]):
            as_session = log_probs(trained, batch)
    finally:
        detach(layers, "session")
    assert (own - base).abs().max() > 1e-3  # the adapter is not the base
    assert torch.allclose(as_session, own, atol=1e-6)


def test_training_a_lora_engine_does_not_import_peft(tiny_model_dir):
    """PEFT only reads and writes the adapter format: building a LoRA engine, an update and the
    reference forward run in a fresh interpreter without importing it."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    script = (
        "import sys\n"
        "from tests.test_lora_engine import make_batch, make_engine, log_probs, train_steps\n"
        f"engine = make_engine({str(tiny_model_dir)!r})\n"
        "train_steps(engine, 1)\n"
        "with engine.adapters_off():\n"
        "    log_probs(engine, make_batch())\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'peft'))\n"
    )
    root = Path(__file__).resolve().parents[1]
    # a process group of its own: this process's engines set MASTER_PORT to a port they hold
    env = {
        k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")
    }
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=root, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "[]"


def test_split_and_dynamic_batches_give_the_same_adapter_gradients(tiny_model_dir):
    grads = []
    for split in ({"micro_batch_size": 1}, {"max_tokens_per_micro_batch": 24}):
        engine = make_engine(tiny_model_dir, micro_batch=split)
        train_steps(engine, 1)  # B moves off zero, so A's gradient is not zero below
        with engine.train_mode():
            engine.forward_backward_batch(make_batch(seed=3), pg_loss("seq-mean-token-mean"))
            grads.append(
                {n: p.grad.clone() for n, p in engine.model.named_parameters() if p.grad is not None}
            )
    assert grads[0].keys() == grads[1].keys()
    for name in grads[0]:
        assert torch.allclose(grads[0][name], grads[1][name], rtol=1e-4, atol=1e-7), name


def test_the_export_is_a_peft_adapter_with_the_trainers_log_probs(tiny_model_dir, trained, tmp_path):
    from peft import PeftModel

    trained.export_hf(str(tmp_path / "export"), merged=True)
    folder = tmp_path / "export"
    config = json.loads((folder / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["lora_alpha"] == 8.0 and config["peft_type"] == "LORA"
    batch = make_batch(seed=11)
    expected = log_probs(trained, batch)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    peft_model = PeftModel.from_pretrained(base, str(folder)).eval()
    merged = AutoModelForCausalLM.from_pretrained(folder / "merged", dtype=torch.float32).eval()
    with torch.no_grad():
        assert torch.allclose(reference_log_probs(peft_model, batch), expected, atol=1e-5)
        assert torch.allclose(reference_log_probs(merged, batch), expected, atol=1e-5)


def test_init_from_an_export_starts_where_it_ended(tiny_model_dir, trained, tmp_path):
    trained.export_hf(str(tmp_path / "adapter"))
    seeded = make_engine(tiny_model_dir, lora={**LORA, "init_from": str(tmp_path / "adapter")})
    batch = make_batch(seed=5)
    assert torch.equal(log_probs(seeded, batch), log_probs(trained, batch))


def test_checkpoints_hold_the_adapter_and_resume_bitwise(tiny_model_dir, tmp_path):
    straight = make_engine(tiny_model_dir)
    train_steps(straight, 2)
    straight.save_checkpoint(str(tmp_path / "step_2"), 2)
    train_steps(straight, 2, seed=10)
    resumed = make_engine(tiny_model_dir)  # a fresh process's engine: new adapters, then the checkpoint
    assert resumed.load_checkpoint(str(tmp_path / "step_2")) == 2
    train_steps(resumed, 2, seed=10)
    a, b = dict(straight.get_per_tensor_param()), dict(resumed.get_per_tensor_param())
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # Only the adapter and its Adam moments were written; the base comes from the model folder.
    saved = FileSystemReader(str(tmp_path / "step_2")).read_metadata().state_dict_metadata
    model_keys = [k for k in saved if k.startswith("model.")]
    assert len(model_keys) == len(a) and all(
        "lora_" in k for k in saved if not k.startswith("optim.param_groups")
    )


def _in_peft_layer_names(obj):
    """A state dict as RL LoRA wrote it on PEFT's layers, which named the one adapter 'default'."""
    if isinstance(obj, str):
        return re.sub(r"\.lora_([AB])\.", r".lora_\1.default.", obj)
    if isinstance(obj, dict):
        return {_in_peft_layer_names(k): _in_peft_layer_names(v) for k, v in obj.items()}
    return [_in_peft_layer_names(v) for v in obj] if isinstance(obj, list) else obj


def test_a_checkpoint_in_peft_layer_names_resumes_to_the_same_numbers(tiny_model_dir, tmp_path):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save, torch_save_to_dcp

    straight = make_engine(tiny_model_dir)
    train_steps(straight, 2)
    new, old = tmp_path / "new", tmp_path / "old"
    straight.save_checkpoint(str(new), 2)
    train_steps(straight, 2, seed=10)
    # the same checkpoint with every adapter name (keys, optimizer state, param groups) in PEFT's naming
    dcp_to_torch_save(str(new), str(tmp_path / "new.pt"))
    torch.save(_in_peft_layer_names(torch.load(tmp_path / "new.pt", weights_only=False)), tmp_path / "old.pt")
    shutil.copytree(new, old, ignore=shutil.ignore_patterns(".metadata", "*.distcp"))
    torch_save_to_dcp(str(tmp_path / "old.pt"), str(old))
    saved = FileSystemReader(str(old)).read_metadata().state_dict_metadata
    assert any(".lora_A.default.weight" in k for k in saved) and not any(".lora_A.weight" in k for k in saved)

    resumed = make_engine(tiny_model_dir)
    assert resumed.load_checkpoint(str(old)) == 2
    train_steps(resumed, 2, seed=10)
    a, b = dict(straight.get_per_tensor_param()), dict(resumed.get_per_tensor_param())
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_the_adapter_sync_serves_the_trainers_policy_on_the_hf_engine(tiny_model_dir, trained):
    rollout = HFRolloutEngine(tiny_model_dir, device="cpu", dtype="float32")
    assert rollout._fused is not None  # decoding reads the fused q/k/v and gate/up buffers the merge writes
    sync = AdapterTransfer(trained, rollout, probe_tolerance=1e-4)
    stats = sync.transfer(trained.get_per_tensor_param())
    adapter_bytes = sum(t.numel() * 4 for _, t in trained.get_per_tensor_param())
    assert stats.bytes == adapter_bytes and stats.metrics()["weight_sync/bytes"] == adapter_bytes
    assert stats.probe_max_abs_diff < 1e-4
    # The engine's own samples, scored by the trainer.
    params = SamplingParams(max_new_tokens=8, temperature=1.0, seed=3)
    prompts = [[5, 6, 7], [9, 10, 11, 12]]
    for prompt, completion in zip(prompts, rollout.generate(prompts, params), strict=True):
        ids = torch.tensor([prompt + completion.token_ids])
        batch = _one_row(ids, len(completion.token_ids))
        trainer = log_probs(trained, batch)[0]
        assert torch.allclose(trainer, torch.tensor(completion.log_probs), atol=1e-4)
    # A second sync merges onto the base, not onto the first merge.
    assert sync.transfer(trained.get_per_tensor_param()).probe_max_abs_diff < 1e-4


def test_a_sync_that_leaves_the_base_policy_fails_loudly(tiny_model_dir, trained):
    class Dropped(HFRolloutEngine):
        def load_adapter(self, config, named_tensors):  # an adapter that never arrives
            return None

    rollout = Dropped(tiny_model_dir, device="cpu", dtype="float32")
    with pytest.raises(AdapterSyncError, match="does not serve the trainer's adapter"):
        AdapterTransfer(trained, rollout, probe_tolerance=1e-3).transfer(trained.get_per_tensor_param())


def two_rank_main(rank: int, port: int, model_dir: str, out_file: str) -> None:
    """One of two gloo ranks: two LoRA updates on this rank's half of each batch, micro-batched."""
    import os

    import torch.distributed as dist

    torch.set_num_threads(1)
    env = {"RANK": str(rank), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    os.environ.update(env)
    engine = make_engine(model_dir, micro_batch={"micro_batch_size": 2})
    with engine.train_mode():
        for seed in range(2):
            batch = make_batch(seed=seed)
            half = batch[rank * len(batch) // 2 : (rank + 1) * len(batch) // 2]
            engine.forward_backward_batch(half, pg_loss("token-mean"))
            engine.optimizer_step()
    adapter = dict(engine.get_per_tensor_param())  # collective: every rank iterates
    if rank == 0:
        torch.save(adapter, out_file)
    dist.barrier()
    dist.destroy_process_group()


def test_two_ranks_train_the_same_adapter_as_one(tiny_model_dir, tmp_path):
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    out = tmp_path / "two.pt"
    mp.spawn(two_rank_main, args=(port, str(tiny_model_dir), str(out)), nprocs=2, join=True)
    two = torch.load(out, weights_only=False)
    one = make_engine(tiny_model_dir)
    train_steps(one, 2)
    expected = dict(one.get_per_tensor_param())
    assert two.keys() == expected.keys()
    for name in expected:
        assert torch.allclose(two[name], expected[name], rtol=1e-4, atol=1e-6), name


def _one_row(ids: torch.Tensor, response: int):
    from tensordict import TensorDict

    return TensorDict(
        {
            "input_ids": ids,
            "attention_mask": torch.ones_like(ids),
            "response_mask": torch.ones(1, response, dtype=torch.long),
        },
        batch_size=[1],
    )


def test_init_from_is_checked_against_the_base_it_was_trained_on(tiny_model_dir, trained, tmp_path):
    """Same shapes, another base: tiny-llama has tiny-qwen2's sizes, so only the adapter's own
    config (base_model_name_or_path) tells them apart."""
    from engines.models.tiny_models import build_builtin_model
    from engines.training.lora_targets import init_from_errors, linear_layers
    from schema.engine import LoraConfig

    trained.export_hf(str(tmp_path / "adapter"))
    llama = build_builtin_model("tiny-llama", tmp_path / "models")
    lora = LoraConfig(**LORA)
    assert init_from_errors(lora, tmp_path / "adapter", linear_layers(tiny_model_dir), tiny_model_dir) is None
    why = init_from_errors(lora, tmp_path / "adapter", linear_layers(llama), llama)
    assert why is not None and "another base model (model_type: qwen2 there, llama here)" in why
    wrong_rank = LoraConfig(**{**LORA, "rank": 8})
    why = init_from_errors(wrong_rank, tmp_path / "adapter", linear_layers(tiny_model_dir))
    assert why is not None and "needs [8, " in why and "model.lora.rank differs" in why
