"""The rollout role: one rollout engine, generation, and the receiving end of weight transfers.

Mesh "rollout" groups `tensor_parallel_size` consecutive ranks into one replica. `generate_sequences`
reads the prompts from non_tensors["prompt_ids"] and the settings from meta (workers/batch.py) and
returns the fixed-width layout (workers/rollout_layout.py), or with an environment multi-turn
trajectories (workers/multiturn.py). A sending training rank in another process calls
`join_transfer`, `receive_weights`, `receive_bucket` or `receive_adapter`.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

import ray
import torch

from engines.rollout import SamplingParams, build_rollout_engine
from engines.rollout.base import Completion
from engines.threads import limit_threads_for_model
from engines.transfer.adapter import serve_adapter
from engines.transfer.base import NamedTensor
from engines.transfer.collective import TransferGroup
from schema.workers import EnvironmentConfig, RolloutConfig, RolloutWorkerConfig
from workers.base import Dispatch, Worker, register
from workers.batch import Batch, environment_of, prompt_length_of, sampling_of
from workers.rollout_layout import rollout_tensors
from workers.transfer_choice import decode_bucket


def rollout_mesh_coords(rank: int, tp: int) -> tuple[int, bool]:
    """(dp rank, is_collect) of a global rank in the rollout mesh of tensor-parallel size `tp`."""
    return rank // tp, rank % tp == 0


class RolloutWorker(Worker):
    def __init__(self, config: RolloutWorkerConfig | dict) -> None:
        super().__init__()
        config = RolloutWorkerConfig.model_validate(config)
        device = "cuda" if torch.cuda.is_available() else "cpu"
        self.build_rollout(config.rollout, config.model_path, device, lora_rank=config.lora_rank)
        limit_threads_for_model(config.model_path)
        self.register_rollout_mesh()
        self.settle_rollout_memory()

    def build_rollout(
        self, rc: RolloutConfig, model_path: str, device: str, lora_rank: int | None = None
    ) -> None:
        """`lora_rank`: the engine serves LoRA adapters up to this rank (vllm, sglang need it up front)."""
        if self.world_size % rc.tensor_parallel_size:
            raise ValueError(
                f"world size {self.world_size} is not a multiple of rollout tensor_parallel_size "
                f"{rc.tensor_parallel_size}"
            )
        self.rollout_config, self.rollout_model_path = rc, model_path
        lora = {"max_lora_rank": lora_rank} if lora_rank is not None else {}
        self.rollout = build_rollout_engine(
            rc.backend, model_path, device=device, dtype=rc.dtype, **lora, **rc.engine_kwargs
        )
        self._chat_delta = None  # built on the first multi-turn generation
        self._transfer_group: TransferGroup | None = None
        self._buckets_received = 0
        self._exit_after_buckets: int | None = None  # a test hook: die mid-transfer

    def register_rollout_mesh(self) -> None:
        dp, collect = rollout_mesh_coords(self.rank, self.rollout_config.tensor_parallel_size)
        self.register_mesh("rollout", dp_rank=dp, is_collect=collect)

    def settle_rollout_memory(self) -> None:
        """Between calls the engine holds no cache (free_cache_after_generate; unset: when short)."""
        release = self.rollout_config.free_cache_after_generate
        if release or (release is None and self.rollout.memory_is_short()):
            self.rollout.release_memory()

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
            replica, _ = rollout_mesh_coords(self.rank, self.rollout_config.tensor_parallel_size)
            params = params.model_copy(update={"seed": params.seed + 7919 * replica})
        environment = environment_of(batch)
        if environment is not None:
            return self._generate_trajectories(batch, params, environment)
        prompts = [list(map(int, p)) for p in batch.non_tensors["prompt_ids"]]
        width = prompt_length_of(batch) or max(len(p) for p in prompts)
        completions = self.generate(prompts, params)
        return Batch(
            rollout_tensors(prompts, completions, width, params.max_new_tokens, self.rollout.pad_token_id),
            batch.non_tensors,
            batch.meta,
        )

    @register(Dispatch.RANK_ZERO)
    def generate(self, prompts: list[list[int]], params: SamplingParams | dict) -> list[Completion]:
        """`len(prompts) * params.n` completions of token-id prompts, prompt-major (one replica)."""
        params = SamplingParams.model_validate(params)
        with self._rolling():
            return self.rollout.generate([list(map(int, p)) for p in prompts], params)

    def _generate_trajectories(
        self, batch: Batch, params: SamplingParams, config: EnvironmentConfig
    ) -> Batch:
        """Multi-turn: one trajectory per row with its environment (workers/multiturn.py)."""
        from workers.multiturn import MultiTurnRollout, trajectory_non_tensors, trajectory_tensors

        if self._chat_delta is None:
            from transformers import AutoTokenizer

            from workers.chat_serving import ChatDelta

            self._chat_delta = ChatDelta(AutoTokenizer.from_pretrained(self.rollout_model_path))
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
        width = prompt_length_of(batch)
        if width is None:
            raise ValueError("a multi-turn batch needs its prompt width (workers.batch.put_prompt_length)")
        with self._rolling():
            trajectories = MultiTurnRollout(self.rollout, self._chat_delta, config).run(rows, params, width)
        tensors = trajectory_tensors(
            trajectories, width, config.max_response_tokens, self.rollout.pad_token_id
        )
        return Batch(tensors, {**batch.non_tensors, **trajectory_non_tensors(trajectories)}, batch.meta)

    @contextmanager
    def _rolling(self) -> Iterator[None]:
        self._before_rollout()
        try:
            yield
        finally:
            self._after_rollout()

    def _before_rollout(self) -> None:
        if self.rollout.is_released:
            self.rollout.resume_memory()

    def _after_rollout(self) -> None:
        self.settle_rollout_memory()

    def join_transfer(
        self, host: str, port: int, rank: int, world: int, backend: str, timeout_s: float
    ) -> None:
        """Join the sender's transfer group as `rank` (engines/transfer/collective.py)."""
        self._transfer_group = TransferGroup.join(host, port, rank, world, backend, timeout_s)

    def receive_weights(self) -> int:
        """One transfer over the group: buckets until the end mark; returns the new weight version."""
        if self._transfer_group is None:
            raise RuntimeError(f"rollout rank {self.rank} has not joined a weight-transfer group")
        for bucket in self._transfer_group.receive_buckets():
            self._apply(bucket)
        return self.finish_transfer()

    def receive_bucket(self, ref: ray.ObjectRef, last: bool = False, timeout_s: float = 300.0) -> int | None:
        """One object-store bucket, applied by name; the `last` one also closes the transfer and returns
        the new weight version."""
        self._apply(self._fetch(ref, timeout_s))
        return self.finish_transfer() if last else None

    def receive_adapter(self, ref: ray.ObjectRef, config: dict, timeout_s: float = 300.0) -> dict:
        """A LoRA adapter in one object-store object, served and probed (engines/transfer/adapter.py)."""
        tensors = self._fetch(ref, timeout_s, copy=True)
        with self._rolling():
            return serve_adapter(self.rollout, config, tensors)

    def _fetch(self, ref: ray.ObjectRef, timeout_s: float, copy: bool = False) -> list[NamedTensor]:
        device = torch.device(getattr(self.rollout, "device", None) or "cpu")
        return [(n, t.to(device, copy=copy)) for n, t in decode_bucket(ray.get(ref, timeout=timeout_s))]

    def finish_transfer(self) -> int:
        version = self.rollout.finish_update()
        self._buckets_received = 0
        self.settle_rollout_memory()
        return version

    def _apply(self, bucket: list[NamedTensor]) -> None:
        if self.rollout.is_released:
            self.rollout.resume_memory()
        self.rollout.update_weights(bucket)
        self._buckets_received += 1
        if self._exit_after_buckets is not None and self._buckets_received >= self._exit_after_buckets:
            os._exit(1)  # the test hook below: this worker dies in the middle of a transfer

    @register(Dispatch.ONE_TO_ALL)
    def weight_version(self) -> int:
        return self.rollout.weight_version

    @register(Dispatch.ONE_TO_ALL)
    def rollout_state_dict(self) -> dict[str, torch.Tensor]:
        """The rollout engine's current weights (CPU copies), for checks that a sync landed."""
        model = getattr(self.rollout, "model", None)
        if model is None:
            raise RuntimeError(f"rollout backend '{self.rollout_config.backend}' does not expose its weights")
        return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}

    @register(Dispatch.ALL_TO_ALL)
    def exit_during_next_transfer(self, after_buckets: int | None) -> None:
        """Test hook: this rank's process exits after `after_buckets` buckets of the next transfer (None:
        never), so a test can check that the sender names the worker that died."""
        self._exit_after_buckets = after_buckets
