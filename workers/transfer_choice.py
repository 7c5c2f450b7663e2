"""Where a training rank's weight-transfer strategy is chosen: the one place that maps a placement,
LoRA and `rollout.weight_transfer` to a strategy (engines/transfer/base.py's interface), and connects
it to the rollout workers over Ray (`RolloutPeers`: a receiver that died or hung fails the transfer
with a `TransferError` naming the rollout group and rank).

Colocated: `InProcessTransfer`, or the adapter alone (`AdapterTransfer`). Split: `collective` or
`object_store`, or the adapter alone in one object (`RemoteAdapterTransfer`). A new strategy is one
file plus one branch here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import ray
import torch

from engines.rollout.base import RolloutEngine
from engines.training.base import TrainEngine
from engines.transfer.adapter import AdapterTransfer, default_tolerance
from engines.transfer.base import TransferError, WeightTransfer
from engines.transfer.collective import CollectiveTransfer, TransferGroup
from engines.transfer.in_process import InProcessTransfer
from workers.object_store_transfer import ObjectStoreTransfer, RemoteAdapterTransfer
from workers.remote import WorkerGroupError, wait_all


@dataclass
class RolloutLink:
    """What a training rank needs to send weights to a rollout group placed apart from it."""

    actors: list[Any]  # the rollout group's Ray actor handles, in rank order
    group: str  # the rollout group's name, for errors
    strategy: str  # "collective" or "object_store"
    timeout_s: float = 300.0


class RolloutPeers:
    """The `Receivers` of engines/transfer/base.py over the rollout group's Ray actors."""

    def __init__(self, actors: list[Any], group: str, timeout_s: float) -> None:
        self.actors, self.group, self.timeout_s = list(actors), group, timeout_s
        self._method = ""
        self._refs: list[ray.ObjectRef] = []

    def __len__(self) -> int:
        return len(self.actors)

    def start(self, method: str, *args: Any) -> None:
        self.start_each(method, [args] * len(self.actors))

    def start_each(self, method: str, per_rank: list[tuple]) -> None:
        self._method = method
        self._refs = [
            actor.execute.remote(method, (args, {}))
            for actor, args in zip(self.actors, per_rank, strict=True)
        ]

    def wait(self, timeout_s: float | None = None) -> list[Any]:
        refs, self._refs = self._refs, []
        try:
            return wait_all(self.group, self._method, refs, timeout_s or self.timeout_s)
        except WorkerGroupError as err:
            raise TransferError(f"weight transfer failed: {err}") from err


def in_process(rollout: RolloutEngine, bucket_mb: float, train: TrainEngine | None = None) -> WeightTransfer:
    """Into a rollout engine of this process: the adapter alone when `train` trains LoRA adapters."""
    if train is not None and train.adapter_config() is not None:
        return AdapterTransfer(train, rollout, default_tolerance(rollout.dtype))
    return InProcessTransfer(rollout, bucket_mb)


def connect(
    link: RolloutLink,
    bucket_mb: float,
    dtype: torch.dtype | None,
    device: torch.device,
    train: TrainEngine | None = None,
) -> WeightTransfer:
    """The sending side of `link.strategy`, connected to every rollout worker of the link (the adapter
    alone when `train` trains LoRA)."""
    peers = RolloutPeers(link.actors, link.group, link.timeout_s)
    if train is not None and train.adapter_config() is not None:
        return RemoteAdapterTransfer(peers, train.adapter_config(), default_tolerance(dtype))
    if link.strategy == "object_store":
        return ObjectStoreTransfer(peers, bucket_mb, dtype)
    if link.strategy == "collective":
        return CollectiveTransfer(_join_group(peers, device, link.timeout_s), peers, bucket_mb, dtype)
    raise ValueError(f"unknown weight transfer '{link.strategy}': use 'collective' or 'object_store'")


def _join_group(peers: RolloutPeers, device: torch.device, timeout_s: float) -> TransferGroup:
    """Host the group's rendezvous here (rank 0) and have every rollout worker join it (ranks 1..)."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    host, world = ray.util.get_node_ip_address(), 1 + len(peers)
    store, port = TransferGroup.host_store(host, world, timeout_s)
    peers.start_each(
        "join_transfer", [(host, port, 1 + r, world, backend, timeout_s) for r in range(len(peers))]
    )
    try:
        group = TransferGroup(store, 0, world, backend, timeout_s, name=f"weight transfer to '{peers.group}'")
    except Exception as exc:  # the rendezvous failed: the receivers say which of them is at fault
        peers.wait(timeout_s=30.0)
        raise TransferError(f"weight-transfer group to '{peers.group}' could not form: {exc}") from exc
    peers.wait()
    return group
