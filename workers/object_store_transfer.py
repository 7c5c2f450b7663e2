"""The object-store strategies: each bucket, or a LoRA adapter whole, is one object in Ray's object
store, read by every rollout worker.

A bucket is put once as uint8 numpy views of its tensors' bytes (no packing copy; receivers on the
node map it without deserialising), bit for bit. The next bucket is put while the receivers apply
the previous one, and the last bucket's call also closes the update. An adapter (placement 'split'
with model.lora) travels in one object whatever `rollout.weight_transfer` says, and each worker
answers the probe's greedy sequence; the trainer's half of the probe is a collective forward, so
`probe_all_ranks` broadcasts the sequences from rank 0 and every rank broadcasts exactly once per
sync, a failed one included, so the ranks stay in step.
"""

from __future__ import annotations

import warnings
from typing import Any

import ray
import torch
import torch.distributed as dist

from engines.training.base import TrainEngine
from engines.transfer.adapter import ProbedAdapterTransfer, probe_difference
from engines.transfer.base import NamedTensor, Receivers, TransferStats, WeightTransfer

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
