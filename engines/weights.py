"""Weight sync: the training engine's parameters streamed into the rollout engine, in buckets.

`WeightSync.sync(train, rollout)` pulls full tensors one at a time from
`train.get_per_tensor_param()` (each one all-gathered lazily across the FSDP ranks), casts them to
the rollout dtype, groups them into buckets of at most `bucket_mb`, and hands each bucket to
`rollout.update_weights`. A tensor larger than a bucket travels alone. At no time is more than
one bucket (plus the tensor being gathered) held, never the whole state dict. After the last
bucket, `rollout.finish_update()` bumps the rollout's weight version. Every sync is measured.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

from engines.base import TrainEngine
from engines.rollout.base import RolloutEngine

NamedTensor = tuple[str, torch.Tensor]


def tensor_bytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def iter_buckets(named_tensors: Iterable[NamedTensor], bucket_bytes: int) -> Iterator[list[NamedTensor]]:
    """Group a stream of named tensors into consecutive buckets of at most `bucket_bytes`.

    A tensor larger than the bucket is yielded alone; order is preserved.
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket size must be positive, got {bucket_bytes} bytes")
    bucket: list[NamedTensor] = []
    size = 0
    for name, tensor in named_tensors:
        nbytes = tensor_bytes(tensor)
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
    if bucket:
        yield bucket


@dataclass(frozen=True)
class SyncStats:
    """One sync: what moved and how fast. `weight_version` is the rollout's version after it."""

    bytes: int
    seconds: float
    buckets: int
    tensors: int
    max_bucket_bytes: int
    weight_version: int

    @property
    def gbps(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0

    def metrics(self) -> dict[str, float]:
        return {
            "weight_sync/seconds": self.seconds,
            "weight_sync/gbps": self.gbps,
            "weight_sync/bytes": float(self.bytes),
            "weight_sync/buckets": float(self.buckets),
            "weight_sync/version": float(self.weight_version),
        }


class WeightSync:
    """The in-process trainer → rollout sync strategy: bucketed, streamed, measured."""

    def __init__(self, bucket_mb: float = 512, dtype: torch.dtype | None = None) -> None:
        if bucket_mb <= 0:
            raise ValueError(f"bucket_mb must be positive, got {bucket_mb}")
        self.bucket_bytes = int(bucket_mb * 1024 * 1024)
        self.dtype = dtype
        self.last: SyncStats | None = None

    def _stream(self, train: TrainEngine) -> Iterator[NamedTensor]:
        for name, tensor in train.get_per_tensor_param():
            if self.dtype is not None and tensor.is_floating_point() and tensor.dtype != self.dtype:
                tensor = tensor.to(self.dtype)
            yield name, tensor

    def sync(self, train: TrainEngine, rollout: RolloutEngine) -> SyncStats:
        start = time.perf_counter()
        total = buckets = tensors = largest = 0
        for bucket in iter_buckets(self._stream(train), self.bucket_bytes):
            size = sum(tensor_bytes(t) for _, t in bucket)
            rollout.update_weights(bucket)
            total, buckets, tensors = total + size, buckets + 1, tensors + len(bucket)
            largest = max(largest, size)
            del bucket  # let the bucket's tensors go before the next one is gathered
        version = rollout.finish_update()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.last = SyncStats(total, time.perf_counter() - start, buckets, tensors, largest, version)
        return self.last
