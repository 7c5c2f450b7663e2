"""The training role: the actor training engine and an optional reference engine (forward only).

On its own (placement 'split', `ActorRefWorker`) rank 0 sends the weights to rollout workers in other
processes, through the strategy workers/transfer_choice.py picks, while every rank helps gather the
full tensors (FSDP). Placement 'colocated' (`ActorRolloutRefWorker`): the same role and the rollout
role in one process, the weights moving between them in process (engines/transfer/in_process.py).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from contextlib import nullcontext

import torch

from engines.rollout.hf import resolve_dtype
from engines.threads import limit_threads_for_model
from engines.training.base import TrainEngine
from engines.training.registry import build_train_engine
from engines.transfer.base import NamedTensor, WeightTransfer
from schema.losses import PolicyLossConfig, SFTLossConfig
from schema.workers import HybridWorkerConfig, UpdateSchedule
from workers.base import Dispatch, Reduce, Worker, register
from workers.batch import Batch
from workers.operations import TrainingOperations, TrainOps, temperature_of, train_on_batch
from workers.rollout_role import RolloutWorker
from workers.transfer_choice import RemoteAdapterTransfer, RolloutLink, connect, in_process, probe_all_ranks


class ActorRefWorker(TrainingOperations):
    """One rank of the training group (actor + optional reference); its fine-grained, checkpoint and
    hyper-parameter operations are `TrainingOperations`' (workers/operations.py)."""

    checkpoint_name = "actor"
    _adapter_remote = False  # syncs are adapter-only to rollout workers elsewhere (probe_all_ranks)

    def __init__(self, config: HybridWorkerConfig | dict) -> None:
        Worker.__init__(self)
        self.config = HybridWorkerConfig.model_validate(config)
        self.actor = build_train_engine(self.config.actor)
        self.actor.initialize()
        self.ops = TrainOps(self.actor)
        self.ref: TrainEngine | None = None
        if self.config.ref is not None:
            self.ref = build_train_engine(self.config.ref.model_copy(update={"trainable": False}))
            self.ref.initialize()
        self.weight_sync: WeightTransfer | None = self.local_transfer()
        limit_threads_for_model(self.config.actor.model_path)  # a small model: one thread
        self.register_mesh("actor", dp_rank=self.actor.dp_rank, is_collect=self.actor.is_collect_rank)

    def local_transfer(self) -> WeightTransfer | None:
        """None: rank 0 connects to rollout workers elsewhere (connect_rollout)."""
        return None

    @register(Dispatch.ONE_TO_ALL)
    def connect_rollout(self, link: RolloutLink) -> None:
        """Rank 0 connects its weight transfer to the rollout workers of `link`; the others only gather."""
        self._adapter_remote = self.actor.adapter_config() is not None
        if self.rank == 0:
            if self.weight_sync is not None:  # a replaced rollout group: the old transfer's peers are gone
                self.weight_sync.close()
                self.weight_sync = None
            dtype = resolve_dtype(self.config.rollout.dtype, self.actor.device.type)
            self.weight_sync = connect(
                link, self.config.rollout.bucket_mb, dtype, self.actor.device, self.actor
            )

    @register(Dispatch.MESH, mesh="actor")
    def compute_log_prob(self, batch: Batch) -> Batch:
        """old_log_probs (and entropy) of the responses under the current actor."""
        with self.actor.eval_mode():
            out = self.ops.forward(batch.tensors, compute_entropy=True, temperature=temperature_of(batch))
        return batch.with_tensors({"old_log_probs": out["log_probs"], "entropy": out["entropy"]})

    @register(Dispatch.MESH, mesh="actor")
    def compute_ref_log_prob(self, batch: Batch) -> Batch:
        if self.config.actor.lora is not None:  # the reference is the actor's base: adapters off
            engine, base = self.actor, self.actor.adapters_off()
        elif self.ref is not None:
            engine, base = self.ref, nullcontext()
        else:
            raise RuntimeError("this worker group has no reference model: set a ref engine config to use KL")
        with engine.eval_mode(), base:
            out = TrainOps(engine).forward(batch.tensors, temperature=temperature_of(batch))
        return batch.with_tensors({"ref_log_probs": out["log_probs"]})

    @register(Dispatch.MESH, mesh="actor", reduce=Reduce.GLOBAL)
    def update_actor(
        self, batch: Batch, loss_config: PolicyLossConfig | dict, schedule: UpdateSchedule | dict
    ) -> dict[str, float]:
        """PPO-style update; the metrics are global (the engine sums them over ranks)."""
        return train_on_batch(
            self.actor, batch, PolicyLossConfig.model_validate(loss_config), schedule, "actor"
        )

    @register(Dispatch.MESH, mesh="actor", reduce=Reduce.GLOBAL)
    def update_sft(self, batch: Batch, agg_mode: str, schedule: UpdateSchedule | dict) -> dict[str, float]:
        """Supervised fine-tuning on prompt/response rows: cross-entropy on the response tokens."""
        return train_on_batch(self.actor, batch, SFTLossConfig(loss_agg_mode=agg_mode), schedule, "sft")

    @register(Dispatch.ONE_TO_ALL, reduce=Reduce.RANK_ZERO)
    def sync_weights(self, names: list[str] | None = None) -> dict[str, float]:
        """Send the actor's weights (all, or those in `names`) to the rollout role; the transfer's
        metrics ({} on a rank that only gathers)."""
        with self.actor.eval_mode():
            stream = self.actor.get_per_tensor_param()
            if names is not None:
                wanted = set(names)
                stream = ((n, t) for n, t in stream if n in wanted)
            if self._adapter_remote:
                return self._send_adapter(stream)
            return self._send_weights(stream)

    def _send_adapter(self, stream: Iterator[NamedTensor]) -> dict[str, float]:
        """The adapter to rollout workers elsewhere, then the probe on every rank; a failed transfer is
        raised after it, so the ranks stay in step."""
        transfer = self.weight_sync if isinstance(self.weight_sync, RemoteAdapterTransfer) else None
        moved, failure = None, None
        try:
            self._send_weights(stream)
            moved = transfer.last if transfer is not None else None
        except Exception as exc:
            failure = exc
        metrics = probe_all_ranks(self.actor, transfer, moved)
        if failure is not None:
            raise failure
        return metrics

    def _send_weights(self, stream: Iterator[NamedTensor]) -> dict[str, float]:
        try:
            return {} if self.weight_sync is None else self.weight_sync.transfer(stream).metrics()
        finally:
            # A rank that only gathers, or a lost receiver: gather the rest with the other ranks,
            # keeping nothing, so that they stay in step (a whole transfer left nothing to gather).
            deque(stream, maxlen=0)

    def after_load_checkpoint(self) -> None:
        """Bring the rollout role to the restored weights."""
        self.sync_weights()

    @register(Dispatch.ONE_TO_ALL, reduce=Reduce.RANK_ZERO)
    def export_hf(self, path: str, merged: bool = False) -> None:
        """The final policy: an HF folder, or with LoRA a PEFT adapter folder (+ `merged/`)."""
        self.actor.export_hf(path, merged)

    @register(Dispatch.ONE_TO_ALL)
    def actor_state_dict(self) -> dict[str, torch.Tensor]:
        with self.actor.eval_mode():
            return {k: v.cpu().clone() for k, v in self.actor.get_per_tensor_param()}


class ActorRolloutRefWorker(ActorRefWorker, RolloutWorker):
    def __init__(self, config: HybridWorkerConfig | dict) -> None:
        ActorRefWorker.__init__(self, config)
        self.register_rollout_mesh()
        self.settle_rollout_memory()

    def local_transfer(self) -> WeightTransfer:
        """The rollout role, built in this process after the training role; weights move in process."""
        lora = self.config.actor.lora
        lora_rank = lora.rank if lora is not None else None
        rc = self.config.rollout
        self.build_rollout(rc, self.config.actor.model_path, str(self.actor.device), lora_rank)
        return in_process(self.rollout, rc.bucket_mb, self.actor)

    def _before_rollout(self) -> None:
        if self.rollout_config.offload_trainer_during_rollout:
            for engine in self._training_engines():
                engine.to("cpu")
        super()._before_rollout()

    def _after_rollout(self) -> None:
        super()._after_rollout()
        if self.rollout_config.offload_trainer_during_rollout:
            for engine in self._training_engines():
                engine.to(str(engine.device))

    def _training_engines(self) -> list[TrainEngine]:
        """What offload_trainer_during_rollout moves: the actor, and a reference model of its own."""
        return [self.actor] if self.ref is None else [self.actor, self.ref]

    def _send_weights(self, stream: Iterator[NamedTensor]) -> dict[str, float]:
        """Into this process's rollout engine, resumed for the copy and released after it."""
        if self.rollout.is_released:
            self.rollout.resume_memory()
        metrics = super()._send_weights(stream)
        self.settle_rollout_memory()
        return metrics
