"""Shared pieces of the training-engine tests: a batch in the engine's layout, reference losses in
the four aggregation modes, and an unsharded Hugging Face reference computed the plain padded way."""

from __future__ import annotations

import torch
from tensordict import TensorDict

from engines.training.base import GlobalCounts

MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def make_batch(batch_size: int = 6, prompt_len: int = 5, resp_len: int = 7, seed: int = 0) -> TensorDict:
    """Left-padded prompts and right-padded responses of different lengths, plus advantages."""
    g = torch.Generator().manual_seed(seed)
    width = prompt_len + resp_len
    ids = torch.randint(4, 99, (batch_size, width), generator=g)
    mask = torch.ones(batch_size, width, dtype=torch.long)
    for row in range(batch_size):
        mask[row, : row % prompt_len] = 0  # left padding of the prompt
        cut = resp_len - (row * 2) % resp_len
        mask[row, prompt_len + max(cut, 1) :] = 0  # right padding of the response (at least 1 token)
    ids = ids * mask  # pad id 0
    return TensorDict(
        {
            "input_ids": ids,
            "attention_mask": mask,
            "responses": ids[:, prompt_len:],
            "response_mask": mask[:, prompt_len:].clone(),
            "advantages": torch.randn(batch_size, resp_len, generator=g),
            # Log-probs of an older trainer and of a rollout engine, for the rollout-corrected loss.
            "old_log_probs": -torch.rand(batch_size, resp_len, generator=g) * 4,
            "rollout_log_probs": -torch.rand(batch_size, resp_len, generator=g) * 4,
        },
        batch_size=[batch_size],
    )


def aggregate(loss_mat: torch.Tensor, mask: torch.Tensor, mode: str, counts: GlobalCounts) -> torch.Tensor:
    """The four aggregation modes, normalised by global counts (the engine's loss contract)."""
    mask = mask.to(loss_mat.dtype)
    if mode == "token-mean":
        return (loss_mat * mask).sum() / counts.tokens
    if mode == "seq-mean-token-sum":
        return (loss_mat * mask).sum(1).sum() / counts.sequences
    if mode == "seq-mean-token-mean":
        return ((loss_mat * mask).sum(1) / mask.sum(1).clamp(min=1)).sum() / counts.sequences
    if mode == "seq-mean-token-sum-norm":
        return (loss_mat * mask).sum() / (counts.sequences * counts.response_width)
    raise ValueError(mode)


def pg_loss(mode: str):
    """A plain policy-gradient loss: -advantage * log_prob, aggregated in `mode`."""

    def loss_fn(micro: TensorDict, outputs: dict, counts: GlobalCounts):
        loss = aggregate(-micro["advantages"] * outputs["log_probs"], micro["response_mask"], mode, counts)
        return loss, {"pg_loss": float(loss.detach())}

    return loss_fn


def rollout_corrected_loss():
    """The actor's PPO loss with token-level truncated IS (a cap that bites on part of the tokens)."""
    from schema.losses import RolloutCorrectionConfig
    from workers.losses import PolicyLossConfig, make_policy_loss

    correction = RolloutCorrectionConfig(is_weights="token", is_cap=1.5)
    return make_policy_loss(PolicyLossConfig(clip_ratio_high=0.28, rollout_correction=correction))


# A case name's suffix: the engine keeps each layer gathered across the call's micro-batches
# (fsdp.reshard_after_forward False, ZeRO-2) where it is sharded.
ZERO2 = "-zero2"


def loss_for(mode: str):
    """`pg_loss(mode)` for an aggregation mode, or the actor's loss: rollout-corrected, or plain for
    the batch with forward-only rows."""
    mode = mode.removesuffix(ZERO2)
    if mode == "forward-only-rows":
        from workers.losses import PolicyLossConfig, make_policy_loss

        return make_policy_loss(PolicyLossConfig())
    return rollout_corrected_loss() if mode == "rollout-corrected" else pg_loss(mode)


def with_zero_advantage_rows(batch: TensorDict, rows: list[int]) -> TensorDict:
    """`batch` with no advantage on `rows`, marked (engines.training.base.NEEDS_BACKWARD) to run forward only."""
    batch = batch.clone()
    batch["advantages"][rows] = 0.0
    batch["needs_backward"] = torch.ones(len(batch), dtype=torch.bool)
    batch["needs_backward"][rows] = False
    return batch


def reference_log_probs(model, batch: TensorDict) -> torch.Tensor:
    """Response log-probs from one padded forward of an unsharded HF model: [B, R]."""
    ids, mask = batch["input_ids"], batch["attention_mask"]
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    logits = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits.float()
    log_probs = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    width = batch["response_mask"].shape[1]
    return log_probs[:, -width:] * batch["response_mask"]


def reference_loss(model, batch: TensorDict, mode: str) -> torch.Tensor:
    rm = batch["response_mask"]
    counts = GlobalCounts(int(rm.sum()), rm.shape[0], rm.shape[1])
    return aggregate(-batch["advantages"] * reference_log_probs(model, batch), rm, mode, counts)


def full_grads(engine) -> dict[str, torch.Tensor]:
    """Full (unsharded) gradients of an FSDP engine, by Hugging Face name."""
    out = {}
    for name, param in engine.model.named_parameters():
        grad = param.grad
        if grad is None:
            continue
        grad = grad.full_tensor() if hasattr(grad, "full_tensor") else grad
        out[type(engine.model).hf_name(name)] = grad.detach().clone()
    return out


def max_rel_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    return max(float((a[k] - b[k]).norm() / b[k].norm().clamp(min=1e-12)) for k in a)


def rank_main(rank: int, world: int, port: int, model_dir: str, cases: list, out_file: str) -> None:
    """One process of a multi-rank engine run. For each (mode, split) case a fresh engine takes this
    rank's half of the batch; rank 0 saves every case's grads, metrics, grad norm and updated params,
    and the grads of the same rows accumulated over two calls."""
    import os

    import torch.distributed as dist

    from engines.training.fsdp.engine import FSDPEngine
    from schema.engine import EngineConfig

    torch.set_num_threads(1)
    os.environ.update(
        {"RANK": str(rank), "WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    )
    results = {}
    for mode, split in cases:
        batch = make_batch()
        if mode == "forward-only-rows":  # rank 0's half has no row to back-propagate
            batch = with_zero_advantage_rows(batch, [0, 1, 2])
        shard = batch[rank * len(batch) // world : (rank + 1) * len(batch) // world]
        fsdp = {"reshard_after_forward": False} if mode.endswith(ZERO2) else {}
        config = EngineConfig(model_path=model_dir, micro_batch=split, optim={"lr": 1e-2}, fsdp=fsdp)
        engine = FSDPEngine(config)
        engine.initialize()
        with engine.train_mode():
            # First the same rows in two calls of unequal size, told the global batch's counts
            # (gradient accumulation, engines/training/base.py); then the case's one call.
            for rows in (shard[:1], shard[1:]):
                engine.forward_backward_batch(rows, loss_for(mode), counts=GlobalCounts.of([batch]))
            accumulated = full_grads(engine)
            engine.optimizer_zero_grad()
            out = engine.forward_backward_batch(shard, loss_for(mode))
            grads = full_grads(engine)
            norm = engine.optimizer_step()
        params = dict(engine.get_per_tensor_param())
        sharded_params = [type(p).__name__ == "DTensor" for p in engine.model.parameters()]
        results[mode] = {
            "kept_gathered": engine.sharded and not engine.reshard_after_forward,
            "all_resharded": all(sharded_params),
            "grads": grads,
            "metrics": out.metrics,
            "norm": norm,
            "params": params,
            "accumulated": accumulated,
        }
    if rank == 0:
        torch.save(results, out_file)
    dist.barrier()
    dist.destroy_process_group()


def checkpoint_rank_main(rank: int, world: int, port: int, model_dir: str, folder: str, mode: str) -> None:
    """One process of a checkpoint run across world sizes. `save`: train one step on the whole
    batch's share of this rank, save a checkpoint, and rank 0 writes the updated weights beside it.
    `load`: a fresh engine loads the checkpoint and rank 0 writes its weights and the Adam step."""
    import os

    import torch.distributed as dist

    from engines.training.fsdp.engine import FSDPEngine
    from schema.engine import EngineConfig

    torch.set_num_threads(1)
    os.environ.update(
        {"RANK": str(rank), "WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    )
    engine = FSDPEngine(EngineConfig(model_path=model_dir, optim={"lr": 1e-2}))
    engine.initialize()
    if mode == "save":
        batch = make_batch()
        shard = batch[rank * len(batch) // world : (rank + 1) * len(batch) // world]
        with engine.train_mode():
            engine.forward_backward_batch(shard, loss_for("token-mean"))
            engine.optimizer_step()
        engine.save_checkpoint(folder, step=1)
    else:
        assert engine.load_checkpoint(folder) == 1
    params = {k: v.clone() for k, v in engine.get_per_tensor_param()}
    # The Adam moments must have come along: one more identical step moves the weights identically.
    with engine.train_mode():
        engine.forward_backward_batch(
            make_batch(seed=1)[rank * 6 // world : (rank + 1) * 6 // world], loss_for("token-mean")
        )
        engine.optimizer_step()
    after = {k: v.clone() for k, v in engine.get_per_tensor_param()}
    if rank == 0:
        torch.save({"params": params, "after": after, "sharded": engine.sharded}, f"{folder}.{mode}.pt")
    dist.barrier()
    dist.destroy_process_group()


def small_llama(seed: int = 0) -> torch.nn.Module:
    """A 4-layer Llama with grouped-query attention (8 query heads, 2 key/value heads), random fp32
    weights: for comparing one implementation of a piece of the model against another."""
    from transformers.models.llama import modeling_llama

    config = modeling_llama.LlamaConfig(
        vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    torch.manual_seed(seed)
    return modeling_llama.LlamaForCausalLM(config)


def log_probs_and_grads(model: torch.nn.Module) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Token log-probs of a fixed batch and every parameter's gradient of a weighted sum of them."""
    ids = torch.randint(0, model.config.vocab_size, (3, 20), generator=torch.Generator().manual_seed(5))
    weights = torch.randn(3, 19, generator=torch.Generator().manual_seed(6))  # every token weighed apart
    model.zero_grad()
    logits = model(ids).logits[:, :-1].float()
    log_probs = logits.log_softmax(-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    (log_probs * weights).sum().backward()
    return log_probs.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def assert_same_model_outputs(got, want) -> None:
    """(log-probs, gradients) of log_probs_and_grads equal: log-probs within 1e-5, each gradient
    with cosine > 0.99999 and its largest difference under 1e-5 of its largest entry."""
    (got_lp, got_grads), (want_lp, want_grads) = got, want
    assert torch.allclose(got_lp, want_lp, rtol=0, atol=1e-5)
    for name, grad in want_grads.items():
        cosine = torch.nn.functional.cosine_similarity(got_grads[name].flatten(), grad.flatten(), dim=0)
        assert cosine > 0.99999, name
        assert (got_grads[name] - grad).abs().max() <= 1e-5 * grad.abs().max(), name
