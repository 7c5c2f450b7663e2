"""GPU checks of the CUDA + NCCL path: the FSDP engine in bf16 and fp32, and the in-process weight sync.

Prints JSON lines. Each numeric check is against a reference computed another way: an unsharded
Hugging Face model on the padded batch (fp32, TF32 off), the rollout engine's own log-probs after a
sync, and a plain tensor copy of the same bytes. Needs one CUDA device; runs without Ray.

    python bench/gpu_check.py [--model qwen2-20m | qwen2-0.5b | FOLDER]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time

import torch

sys.path.insert(0, __file__.rsplit("/bench/", 1)[0])

from engines.kernels.logprobs import token_log_probs  # noqa: E402
from engines.models.tiny_models import builtin_or_folder  # noqa: E402
from engines.rollout import SamplingParams, build_rollout_engine  # noqa: E402
from engines.training.fsdp.engine import FSDPEngine  # noqa: E402
from engines.transfer.in_process import InProcessTransfer  # noqa: E402
from schema.engine import EngineConfig  # noqa: E402
from tests.engine_util import make_batch, pg_loss, reference_log_probs  # noqa: E402


def emit(**record) -> None:
    print(json.dumps(record), flush=True)


def grouped(batch, n: int):
    """The batch with every n consecutive rows sharing their first row's prompt (as GRPO's groups do),
    so the engine packs each prompt once (engines/kernels/shared_prompt.py)."""
    batch = batch.clone()
    width = batch["responses"].shape[1]
    for lead in range(0, len(batch), n):
        for row in range(lead + 1, min(lead + n, len(batch))):
            batch["input_ids"][row, :-width] = batch["input_ids"][lead, :-width]
            batch["attention_mask"][row, :-width] = batch["attention_mask"][lead, :-width]
    return batch


def engine_vs_reference(model_dir: str, dtype: str, group: int = 1) -> None:
    from transformers import AutoModelForCausalLM

    batch = make_batch(batch_size=8, prompt_len=16, resp_len=24, seed=1)
    batch = (grouped(batch, group) if group > 1 else batch).to("cuda")
    engine = FSDPEngine(EngineConfig(model_path=model_dir, device="cuda", dtype=dtype, optim={"lr": 1e-4}))
    engine.initialize()
    ref = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="sdpa"
    ).cuda()
    with torch.no_grad():
        want = reference_log_probs(ref, batch)
    width = batch["responses"].shape[1]
    shared = engine._prompt_groups(batch.cpu(), width) is not None
    with engine.train_mode():
        out = engine.forward_backward_batch(batch, pg_loss("token-mean"), compute_entropy=True)
        norm = engine.optimizer_step()
    mask = batch["response_mask"].bool().cpu()
    gap = (out.outputs["log_probs"] - want.cpu()).abs()[mask]
    emit(
        check="engine_log_probs_vs_hf_fp32",
        prompts_shared_by=group,
        shared_prompt_path=shared,
        dtype=str(engine.compute_dtype),
        attn=engine.attn_implementation,
        max_abs_diff=float(gap.max()),
        mean_abs_diff=float(gap.mean()),
        grad_norm=norm,
        backend=str(torch.distributed.get_backend()),
    )
    return engine


def sync_and_generate(engine: FSDPEngine, model_dir: str) -> None:
    rollout = build_rollout_engine("hf", model_dir, device="cuda", dtype="bfloat16")
    sync = InProcessTransfer(rollout, bucket_mb=64)
    with engine.eval_mode():
        stats = sync.transfer(engine.get_per_tensor_param())
        trainer = {k: v.to(rollout.dtype) for k, v in engine.get_per_tensor_param()}
    rollout_sd = rollout.model.state_dict()
    equal = all(torch.equal(trainer[k], rollout_sd[k]) for k in trainer)
    # The copy baseline: the same tensors, already gathered, copied into preallocated buffers.
    dst = {k: torch.empty_like(v) for k, v in trainer.items()}
    torch.cuda.synchronize()
    start = time.perf_counter()
    for k, v in trainer.items():
        dst[k].copy_(v)
    torch.cuda.synchronize()
    copy_s = time.perf_counter() - start
    emit(
        check="weight_sync_cuda",
        bytes=stats.bytes,
        buckets=stats.buckets,
        sync_gbps=stats.gbps,
        copy_gbps=stats.bytes / copy_s / 1e9,
        ratio=stats.gbps / (stats.bytes / copy_s / 1e9),
        weights_bitwise_equal=equal,
        version=stats.weight_version,
    )
    prompts = [[5 + i, 6 + i, 7 + i] for i in range(16)]
    completions = rollout.generate(prompts, SamplingParams(max_new_tokens=16, temperature=1.0, seed=0))
    emit(check="rollout_generate_cuda", completions=len(completions), version=completions[0].weight_version)


def chunked_head_grads(tokens: int = 2048, hidden_size: int = 896, vocab: int = 151936) -> None:
    """The chunked vocabulary head in bf16 (engines/kernels/logprobs.py: its weight gradient on the tensor cores
    with an fp32 result) against autograd through an fp32 log-softmax of the same bf16 inputs."""
    g = torch.Generator(device="cuda").manual_seed(0)
    hidden = torch.randn(tokens, hidden_size, device="cuda", generator=g).bfloat16().requires_grad_()
    weight = (torch.randn(vocab, hidden_size, device="cuda", generator=g) * 0.02).bfloat16().requires_grad_()
    targets = torch.randint(0, vocab, (tokens,), device="cuda", generator=g)
    upstream = torch.randn(tokens, device="cuda", generator=g)
    log_probs, _ = token_log_probs(hidden, weight, targets, chunk_tokens=1024)
    (log_probs * upstream).sum().backward()
    h32 = hidden.detach().float().requires_grad_()
    w32 = weight.detach().float().requires_grad_()
    want = torch.log_softmax(h32 @ w32.t(), -1).gather(-1, targets[:, None]).squeeze(-1)
    (want * upstream).sum().backward()

    def rel(a: torch.Tensor, b: torch.Tensor) -> float:
        return float((a.float() - b).abs().max() / b.abs().max())

    emit(
        check="chunked_head_bf16_vs_fp32_autograd",
        log_probs_max_abs_diff=float((log_probs - want).detach().abs().max()),
        grad_weight_rel_diff=rel(weight.grad, w32.grad),
        grad_hidden_rel_diff=rel(hidden.grad, h32.grad),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="qwen2-20m", help="a built-in name or a model folder")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        emit(check="skipped", reason="no CUDA device")
        return
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    emit(check="device", name=torch.cuda.get_device_name(), torch=torch.__version__)
    chunked_head_grads()
    model_dir = str(builtin_or_folder(args.model, tempfile.mkdtemp()))
    engine_vs_reference(model_dir, "float32")
    engine_vs_reference(model_dir, "float32", group=4)
    engine_vs_reference(model_dir, "bfloat16", group=4)
    engine = engine_vs_reference(model_dir, "bfloat16")
    sync_and_generate(engine, model_dir)


if __name__ == "__main__":
    main()
