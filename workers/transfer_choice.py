"""A training rank's weight transfer to rollout workers: the one place that maps a placement, LoRA and
`rollout.weight_transfer` to a strategy (engines/transfer/base.py's interface), the connection over
Ray (`RolloutPeers`: a receiver that died or raised fails the transfer with a `TransferError` naming the
rollout group and rank, one that stopped answering with a `TransferTimeout` naming its pid and node too),
and the object-store strategies.

Colocated: `InProcessTransfer`, or the adapter alone (`AdapterTransfer`). Split: `collective` or
`object_store`, or the adapter alone in one object (`RemoteAdapterTransfer`). A new strategy is one
file plus one branch in `connect`. An object-store bucket is put once as uint8 numpy views of its
tensors' bytes (receivers on the node map it without deserialising); the next bucket is put while the
receivers apply the previous one. The trainer's half of an adapter's probe is a collective forward, so
`probe_all_ranks` broadcasts the workers' sequences from rank 0, once per sync, a failed one included.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

import ray
import torch
import torch.distributed as dist

from engines.rollout.base import RolloutEngine
from engines.training.base import TrainEngine
from engines.transfer.adapter import (
    AdapterTransfer,
    ProbedAdapterTransfer,
    default_tolerance,
    probe_difference,
)
from engines.transfer.base import (
    NamedTensor,
    Receivers,
    TransferError,
    TransferStats,
    TransferTimeout,
    WeightTransfer,
)
from engines.transfer.collective import ABORT_GRACE_S, CollectiveTransfer, TransferGroup
from engines.transfer.in_process import InProcessTransfer
from workers.remote import WorkerGroupError, wait_all

EncodedBucket = list[tuple[str, str, tuple[int, ...], Any]]  # (name, dtype, shape, uint8 ndarray)


def encode_bucket(bucket: list[NamedTensor]) -> EncodedBucket:
    """Each tensor as a uint8 numpy view of its bytes (a copy only off the CPU or if not contiguous)."""
    return [
        (
            name,
            str(t.dtype).removeprefix("torch."),
            tuple(t.shape),
            t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy(),
        )
        for name, t in bucket
    ]


def decode_bucket(encoded: EncodedBucket) -> list[NamedTensor]:
    """The bucket as tensors viewing the (read-only, shared) arrays: copy them, never write them."""
    with warnings.catch_warnings():  # torch warns that the arrays are not writable
        warnings.simplefilter("ignore", UserWarning)
        return [(n, torch.from_numpy(a).view(getattr(torch, d)).view(s)) for n, d, s, a in encoded]


class ObjectStoreTransfer(WeightTransfer):
    def __init__(
        self, receivers: Receivers, bucket_mb: float = 512, dtype: torch.dtype | None = None
    ) -> None:
        super().__init__(bucket_mb, dtype)
        self.receivers = receivers
        self._held: ray.ObjectRef | None = None  # put, not yet sent: it may be the last bucket
        self._in_flight = False

    def begin(self) -> None:
        self._held, self._in_flight = None, False

    def send(self, bucket: list[NamedTensor]) -> None:
        ref = ray.put(encode_bucket(bucket))
        if self._held is not None:
            self._start(self._held, last=False)
        self._held = ref

    def finish(self) -> int:
        if self._held is None:  # nothing was sent: only close the update
            self.receivers.start("finish_transfer")
            return int(self.receivers.wait()[0])
        self._start(self._held, last=True)  # the last bucket closes the update in the same call
        self._held, self._in_flight = None, False
        return int(self.receivers.wait()[0])

    def _start(self, ref: ray.ObjectRef, last: bool) -> None:
        if self._in_flight:
            self.receivers.wait()  # the previous bucket has landed everywhere
        self.receivers.start("receive_bucket", ref, last)
        self._in_flight = True

    def abort(self, error: BaseException) -> BaseException:
        self._held, self._in_flight = None, False
        return error  # RolloutPeers.wait already named the receiver that failed


class RemoteAdapterTransfer(ProbedAdapterTransfer):
    """The adapter in one object to every rollout worker (`RolloutWorker.receive_adapter`); the probe
    is checked by `probe_all_ranks`."""

    def __init__(self, receivers: Receivers, adapter_config: dict, probe_tolerance: float) -> None:
        super().__init__(adapter_config, probe_tolerance)
        self.receivers = receivers

    def deliver(self, tensors: list[NamedTensor]) -> list[dict]:
        self.receivers.start("receive_adapter", ray.put(encode_bucket(tensors)), self.adapter_config)
        return self.receivers.wait()

    def receiver(self, index: int) -> str:
        return f"rollout worker rank {index} of '{self.receivers.group}'"


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


@dataclass
class RolloutLink:
    """What a training rank needs to send weights to a rollout group placed apart from it."""

    actors: list[Any]  # the rollout group's Ray actor handles, in rank order
    group: str  # the rollout group's name, for errors
    strategy: str  # "collective" or "object_store"
    timeout_s: float = 300.0
    hosts: list[str] | None = None  # "pid 123 on 10.0.0.1" for each rank, for errors


class RolloutPeers:
    """The `Receivers` of engines/transfer/base.py over the rollout group's Ray actors."""

    def __init__(
        self, actors: list[Any], group: str, timeout_s: float, hosts: list[str] | None = None
    ) -> None:
        self.actors, self.group, self.timeout_s, self.hosts = list(actors), group, timeout_s, hosts
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
            return wait_all(self.group, self._method, refs, timeout_s or self.timeout_s, self.hosts)
        except WorkerGroupError as err:
            if err.kind in ("timeout", "hung"):  # alive to Ray but silent: stopped, or too slow
                message = f"weight transfer to '{self.group}' timed out waiting for a receiver: {err}"
                raise TransferTimeout(message, self.group, err.rank, self._method) from err
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
    peers = RolloutPeers(link.actors, link.group, link.timeout_s, link.hosts)
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
        peers.wait(timeout_s=min(timeout_s / 2, ABORT_GRACE_S))
        raise TransferError(f"weight-transfer group to '{peers.group}' could not form: {exc}") from exc
    peers.wait()
    return group
