"""The hybrid actor-rollout-ref worker: in one process, a training engine beside a rollout engine.

Per rank: the actor training engine, an optional reference engine (forward only), and a rollout
engine holding its own copy of the policy. Weights move from the actor to the rollout engine in
this process, bucketed through the engines' own APIs (`engines/weights.py`); nothing else copies
them.

Meshes: "actor" is the FSDP data-parallel layout (every rank its own dp rank, every rank
collected); "rollout" groups `tensor_parallel_size` consecutive ranks into one rollout replica
(dp rank = rank // tp, collected on tp rank 0). With tp = 1 the two coincide.

Generation layout. The controller sends a Batch whose non_tensors["prompt_ids"] hold token-id lists
(one row per sample: prompts already repeated n times) and whose meta holds the SamplingParams
(`workers.batch.put_sampling`) and "max_prompt_length". Outputs have fixed widths, so that the chunks of
all dp ranks concatenate: input_ids = prompt left-padded to P = max_prompt_length, then the
response right-padded to R = max_new_tokens.
"""

from __future__ import annotations

from contextlib import nullcontext
from itertools import chain

import torch
from tensordict import TensorDict

from engines.adapter_sync import AdapterSync, default_tolerance
from engines.base import NEEDS_BACKWARD, TrainEngine
from engines.registry import build_train_engine
from engines.rollout import SamplingParams, build_rollout_engine
from engines.threads import limit_threads_for_model
from engines.weights import WeightSync
from workers.base import Dispatch, Worker, register
from workers.batch import Batch, sampling_of
from workers.config import HybridWorkerConfig, RolloutConfig, UpdateSchedule
from workers.loss_config import PolicyLossConfig
from workers.training import train_on_batch


def rollout_mesh_coords(rank: int, tp: int) -> tuple[int, bool]:
    """(dp rank, is_collect) of a global rank in the rollout mesh of tensor-parallel size `tp`."""
    return rank // tp, rank % tp == 0


class ActorRolloutRefWorker(Worker):
    """One rank of the colocated actor + reference + rollout group. See the module docstring."""

    def __init__(self, config: HybridWorkerConfig | dict) -> None:
        super().__init__()
        self.config = HybridWorkerConfig.model_validate(config)
        if self.world_size % self.config.rollout.tensor_parallel_size:
            raise ValueError(
                f"world size {self.world_size} is not a multiple of rollout tensor_parallel_size "
                f"{self.config.rollout.tensor_parallel_size}"
            )
        self.actor = build_train_engine(self.config.actor)
        self.actor.initialize()
        self.ref: TrainEngine | None = None
        if self.config.ref is not None:
            self.ref = build_train_engine(self.config.ref.model_copy(update={"trainable": False}))
            self.ref.initialize()
        rc: RolloutConfig = self.config.rollout
        lora = self.config.actor.lora
        self.rollout = build_rollout_engine(
            rc.backend,
            self.config.actor.model_path,
            device=str(self.actor.device),
            dtype=rc.dtype,
            **({"max_lora_rank": lora.rank} if lora is not None else {}),
            **rc.engine_kwargs,
        )
        # LoRA: only the adapter moves, probed after every sync (engines/adapter_sync.py).
        self.weight_sync = (
            AdapterSync(default_tolerance(self.rollout.dtype))
            if lora is not None
            else WeightSync(rc.bucket_mb, dtype=self.rollout.dtype)
        )
        limit_threads_for_model(self.config.actor.model_path)  # a small model: one thread
        self.register_mesh("actor", dp_rank=self.actor.dp_rank, is_collect=self.actor.is_collect_rank)
        dp, collect = rollout_mesh_coords(self.rank, rc.tensor_parallel_size)
        self.register_mesh("rollout", dp_rank=dp, is_collect=collect)
        if rc.free_cache_after_generate:
            self.rollout.release_memory()
        self._chat_delta = None  # built on the first multi-turn generation

    # ---- generation --------------------------------------------------------------------------

    @register(Dispatch.MESH, mesh="rollout")
    def generate_sequences(self, batch: Batch) -> Batch:
        """Sample one response per row; returns the batch with the fixed-width training layout."""
        params = sampling_of(batch)
        if params is None:
            raise ValueError(
                "generate_sequences needs the batch's sampling settings (workers.batch.put_sampling)"
            )
        params = params.model_copy(update={"n": 1})
        if params.seed is not None:  # replicas must not draw the same samples; tp peers must
            replica, _ = rollout_mesh_coords(self.rank, self.config.rollout.tensor_parallel_size)
            params = params.model_copy(update={"seed": params.seed + 7919 * replica})
        if batch.meta.get("environment"):
            return self._generate_trajectories(batch, params)
        prompts = [list(map(int, p)) for p in batch.non_tensors["prompt_ids"]]
        width = int(batch.meta.get("max_prompt_length") or max(len(p) for p in prompts))
        self._before_rollout()
        try:
            completions = self.rollout.generate(prompts, params)
        finally:
            self._after_rollout()
        return Batch(
            _rollout_tensors(prompts, completions, width, params.max_new_tokens, self.rollout.pad_token_id),
            batch.non_tensors,
            batch.meta,
        )

    def _generate_trajectories(self, batch: Batch, params: SamplingParams) -> Batch:
        """Multi-turn: one trajectory per row with its environment (workers/multiturn.py)."""
        from workers.multiturn import (
            EnvironmentConfig,
            MultiTurnRollout,
            trajectory_non_tensors,
            trajectory_tensors,
        )

        config = EnvironmentConfig.model_validate(batch.meta["environment"])
        if self._chat_delta is None:
            from transformers import AutoTokenizer

            from workers.chat_delta import ChatDelta

            self._chat_delta = ChatDelta(AutoTokenizer.from_pretrained(self.config.actor.model_path))
        nt = batch.non_tensors
        rows = [
            {"prompt": p, "ground_truth": g, "extra": e}
            for p, g, e in zip(
                nt.get("raw_prompt", nt["prompt"]),
                nt.get("ground_truth", [None] * len(batch)),
                nt.get("extra", [None] * len(batch)),
                strict=True,
            )
        ]
        width = int(batch.meta["max_prompt_length"])
        self._before_rollout()
        try:
            trajectories = MultiTurnRollout(self.rollout, self._chat_delta, config).run(rows, params, width)
        finally:
            self._after_rollout()
        tensors = trajectory_tensors(
            trajectories, width, config.max_response_tokens, self.rollout.pad_token_id
        )
        return Batch(tensors, {**batch.non_tensors, **trajectory_non_tensors(trajectories)}, batch.meta)

    def _before_rollout(self) -> None:
        if self.config.rollout.offload_trainer_during_rollout:
            self.actor.to("cpu")
        if self.rollout.is_released:
            self.rollout.resume_memory()

    def _after_rollout(self) -> None:
        if self.config.rollout.free_cache_after_generate:
            self.rollout.release_memory()
        if self.config.rollout.offload_trainer_during_rollout:
            self.actor.to(str(self.actor.device))

    # ---- log-probs and updates ---------------------------------------------------------------

    @register(Dispatch.MESH, mesh="actor")
    def compute_log_prob(self, batch: Batch) -> Batch:
        """old_log_probs (and entropy) of the responses under the current actor."""
        with self.actor.eval_mode():
            out = self.actor.forward_backward_batch(
                batch.tensors, None, forward_only=True, compute_entropy=True, temperature=_temperature(batch)
            )
        return _with_outputs(
            batch, {"old_log_probs": out.outputs["log_probs"], "entropy": out.outputs["entropy"]}
        )

    @register(Dispatch.MESH, mesh="actor")
    def compute_ref_log_prob(self, batch: Batch) -> Batch:
        if self.config.actor.lora is not None:  # the reference is the actor's base: adapters off
            engine, base = self.actor, self.actor.adapters_off()
        elif self.ref is not None:
            engine, base = self.ref, nullcontext()
        else:
            raise RuntimeError("this worker group has no reference model: set a ref engine config to use KL")
        with engine.eval_mode(), base:
            out = engine.forward_backward_batch(
                batch.tensors, None, forward_only=True, temperature=_temperature(batch)
            )
        return _with_outputs(batch, {"ref_log_probs": out.outputs["log_probs"]})

    @register(Dispatch.MESH, mesh="actor")
    def update_actor(
        self, batch: Batch, loss_config: PolicyLossConfig | dict, schedule: UpdateSchedule | dict
    ) -> dict[str, float]:
        """PPO-style update; the metrics are global (the engine sums them over ranks)."""
        from workers.losses import make_policy_loss, rows_with_gradient

        cfg = PolicyLossConfig.model_validate(loss_config)
        loss_fn = make_policy_loss(cfg)
        if "old_log_probs" not in batch.tensors.keys():
            loss_fn = _old_log_probs_from_current(loss_fn)
        # Rows with a zero advantage everywhere run forward only (metrics), never backward.
        with_gradient = rows_with_gradient(cfg, batch.tensors)
        if with_gradient is not None:
            batch = _with_outputs(batch, {NEEDS_BACKWARD: with_gradient})
        # Entropy is always computed so the dashboard's Entropy chart has actor/entropy; it joins the
        # loss only with a non-zero entropy_coeff.
        metrics = train_on_batch(
            self.actor,
            batch,
            loss_fn,
            schedule,
            "actor",
            compute_entropy=True,
            temperature=_temperature(batch),
        )
        return metrics

    @register(Dispatch.MESH, mesh="actor")
    def update_sft(self, batch: Batch, agg_mode: str, schedule: UpdateSchedule | dict) -> dict[str, float]:
        """Supervised fine-tuning on prompt/response rows: cross-entropy on the response tokens."""
        from workers.losses import make_sft_loss

        return train_on_batch(self.actor, batch, make_sft_loss(agg_mode), schedule, "sft")

    @register(Dispatch.ONE_TO_ALL)
    def sync_weights(self) -> dict[str, float]:
        """Stream the actor's weights into this rank's rollout engine; returns the sync's metrics."""
        with self.actor.eval_mode():
            if self.rollout.is_released:
                self.rollout.resume_memory()
            stats = self.weight_sync.sync(self.actor, self.rollout)
            if self.config.rollout.free_cache_after_generate:
                self.rollout.release_memory()
        return stats.metrics()

    @register(Dispatch.ONE_TO_ALL)
    def weight_version(self) -> int:
        return self.rollout.weight_version

    @register(Dispatch.ONE_TO_ALL)
    def set_hyperparameters(self, lr: float | None = None) -> None:
        if lr is not None:
            self.actor.set_learning_rate(lr)

    # ---- checkpoints ---------------------------------------------------------------------------

    @register(Dispatch.ONE_TO_ALL)
    def save_checkpoint(self, path: str, step: int) -> None:
        self.actor.save_checkpoint(f"{path}/actor", step)

    @register(Dispatch.ONE_TO_ALL)
    def load_checkpoint(self, path: str) -> int:
        """Restore the actor and bring the rollout engine to the restored weights."""
        step = self.actor.load_checkpoint(f"{path}/actor")
        self.sync_weights()
        return step

    @register(Dispatch.ONE_TO_ALL)
    def export_hf(self, path: str, merged: bool = False) -> None:
        self.actor.export_hf(path, merged)

    # ---- test and debugging hooks ---------------------------------------------------------------

    @register(Dispatch.ONE_TO_ALL)
    def rollout_state_dict(self) -> dict[str, torch.Tensor]:
        """The rollout engine's current weights (CPU copies), for checks that a sync landed."""
        model = getattr(self.rollout, "model", None)
        if model is None:
            raise RuntimeError(f"rollout backend '{self.config.rollout.backend}' does not expose its weights")
        return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}

    @register(Dispatch.ONE_TO_ALL)
    def actor_state_dict(self) -> dict[str, torch.Tensor]:
        with self.actor.eval_mode():
            return {k: v.cpu().clone() for k, v in self.actor.get_per_tensor_param()}


def _old_log_probs_from_current(loss_fn):
    """Wrap a policy loss for a single on-policy step: old log-probs are the current ones, detached.

    Only valid when this forward is the first of the update (one mini-batch, one epoch), so the
    policy has not moved yet; the trainer decides that. The policy loss then measures the rollout
    engine's mismatch and applies the rollout correction against these same values.
    """

    def wrapped(micro, outputs, counts):
        micro["old_log_probs"] = outputs["log_probs"].detach()
        return loss_fn(micro, outputs, counts)

    return wrapped


def _temperature(batch: Batch) -> float:
    params = sampling_of(batch)
    temperature = params.temperature if params is not None else 1.0
    return temperature if temperature > 0 else 1.0  # greedy: log-probs of the plain model


def _with_outputs(batch: Batch, outputs: dict[str, torch.Tensor]) -> Batch:
    tensors = batch.tensors.clone(recurse=False)
    for key, value in outputs.items():
        tensors[key] = value
    return Batch(tensors, batch.non_tensors, batch.meta)


def _rollout_tensors(
    prompts: list[list[int]], completions: list, width: int, new_tokens: int, pad: int
) -> TensorDict:
    """Prompt left-padded to `width`, response right-padded to `new_tokens`, with masks, log-probs,
    weight versions and the truncation flags."""
    rows = len(prompts)
    prompt_lengths = torch.tensor([len(p) for p in prompts], dtype=torch.long)
    if rows and int(prompt_lengths.max()) > width:
        raise ValueError(
            f"prompt of {int(prompt_lengths.max())} tokens is longer than max_prompt_length={width}"
        )
    tokens = [c.token_ids[:new_tokens] for c in completions]
    token_lengths = torch.tensor([len(t) for t in tokens], dtype=torch.long)
    input_ids = torch.full((rows, width + new_tokens), pad, dtype=torch.long)
    _place_rows(input_ids, prompts, width - prompt_lengths)
    _place_rows(input_ids, tokens, torch.full((rows,), width))
    columns = torch.arange(width + new_tokens)
    attention_mask = (
        (columns >= (width - prompt_lengths)[:, None]) & (columns < (width + token_lengths)[:, None])
    ).long()
    log_probs = torch.zeros(rows, new_tokens)
    _place_rows(log_probs, [c.log_probs[: len(t)] for c, t in zip(completions, tokens, strict=True)])
    # 1 where generation stopped at the token budget (finish reason "length"), for over-long handling.
    truncated = torch.tensor([c.finish_reason == "length" for c in completions], dtype=torch.long)
    return TensorDict(
        {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "responses": input_ids[:, width:].clone(),
            "response_mask": attention_mask[:, width:].clone(),
            "rollout_log_probs": log_probs,
            "weight_version": torch.tensor([c.weight_version for c in completions], dtype=torch.long),
            "truncated": truncated,
        },
        batch_size=[rows],
    )


def _place_rows(out: torch.Tensor, rows: list[list], starts: torch.Tensor | None = None) -> None:
    """Write row i of `rows` into out[i, starts[i] : starts[i] + len(rows[i])] (starts: 0), with one
    indexed copy for the whole batch rather than a copy per row."""
    lengths = torch.tensor([len(r) for r in rows], dtype=torch.long)
    total = int(lengths.sum())
    if total == 0:
        return
    row = torch.repeat_interleave(torch.arange(len(rows)), lengths)
    column = torch.arange(total) - torch.repeat_interleave(lengths.cumsum(0) - lengths, lengths)
    if starts is not None:
        column += starts[row]
    out[row, column] = torch.tensor(list(chain.from_iterable(rows)), dtype=out.dtype)
