"""Adapter-only sync to rollout workers in other processes (placement 'split' with model.lora).

Rank 0 puts the adapter in Ray's object store as one object (whatever `rollout.weight_transfer`
says: an adapter is small) and each rollout worker loads it and generates the probe's greedy
sequence. The trainer's half of the probe is a collective forward, so `probe_all_ranks` broadcasts
the sequences from rank 0 and every rank runs it; every rank broadcasts exactly once per sync, a
failed one included, so the ranks stay in step.
"""

from __future__ import annotations

from typing import Any

import ray
import torch
import torch.distributed as dist

from engines.training.base import TrainEngine
from engines.transfer.adapter import ProbedSyncStats, check_probe, probe_difference
from engines.transfer.base import NamedTensor, TransferStats, WeightTransfer
from workers.object_store_transfer import encode_bucket
from workers.transfer_peers import RolloutPeers


class RemoteAdapterTransfer(WeightTransfer):
    name = "adapter_object_store"

    def __init__(self, receivers: RolloutPeers, adapter_config: dict, probe_tolerance: float) -> None:
        super().__init__(dtype=torch.float32)  # adapters travel in fp32 (also over a bf16 base)
        self.receivers, self.adapter_config = receivers, adapter_config
        self.probe_tolerance = probe_tolerance
        self._tensors: list[NamedTensor] = []
        self.served: list[tuple[list[int], list[float]]] = []  # each worker's probe sequence

    def begin(self) -> None:
        self._tensors, self.served = [], []

    def send(self, bucket: list[NamedTensor]) -> None:
        self._tensors.extend((name, tensor.detach().cpu()) for name, tensor in bucket)

    def finish(self) -> int:
        tensors, self._tensors = self._tensors, []
        self.receivers.start("receive_adapter", ray.put(encode_bucket(tensors)), self.adapter_config)
        replies = self.receivers.wait()
        self.served = [(list(r["tokens"]), list(r["log_probs"])) for r in replies]
        return int(replies[0]["version"])

    def checked(self, moved: TransferStats, differences: list[float]) -> ProbedSyncStats:
        """The stats with the probe's result; AdapterSyncError past the tolerance names the worst worker."""
        worst = max(range(len(differences)), key=differences.__getitem__, default=0)
        stats = ProbedSyncStats(
            **vars(moved),
            probe_max_abs_diff=differences[worst] if differences else 0.0,
            parameters=moved.bytes // 4,  # fp32
        )
        self.last = stats
        check_probe(stats, self.probe_tolerance, f"rollout worker rank {worst} of '{self.receivers.group}'")
        return stats


def probe_all_ranks(
    train: TrainEngine, transfer: RemoteAdapterTransfer | None, moved: TransferStats | None
) -> dict[str, float]:
    """Every training rank: the trainer's half of the probe of the sync that just ran. Rank 0 (holding
    `transfer`; `moved` None when it failed) broadcasts the workers' sequences; its metrics, {} elsewhere."""
    served: list[Any] = [transfer.served if transfer is not None and moved is not None else None]
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(served, src=0)
    if served[0] is None:
        return {}
    differences = [probe_difference(train, tokens, log_probs) for tokens, log_probs in served[0]]
    if transfer is None or moved is None:
        return {}
    return transfer.checked(moved, differences).metrics()
