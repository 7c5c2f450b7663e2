"""Weight transfer: how the trainer's weights reach a rollout engine, as interchangeable strategies.

A strategy is the sending side of one way to move weights: `begin()`, `send(bucket)` per bucket of
(HF name, full tensor) pairs, `finish()` returning the receivers' new weight version. `transfer`
drives one whole transfer: cast to the receivers' dtype, cut into buckets of at most `bucket_mb`, at
most one bucket held at a time. The stream may be any named subset of the model (one layer, an
adapter). One file per strategy; those that need Ray live in workers/; workers/transfer_choice.py picks.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import torch

NamedTensor = tuple[str, torch.Tensor]


class TransferError(RuntimeError):
    """A weight transfer failed; the message names the receiving worker (group, rank) at fault."""

    names_its_worker = True  # a collective's timeout inside it is not its group's (workers/remote.py)


class TransferTimeout(TransferError):
    """A receiver did not take part in a transfer within its limit (stopped, or too slow): `group` and
    `rank` name it, `method` the receiving call it did not answer. Job recovery retries it as that
    worker's loss, where any other TransferError is the job's own."""

    def __init__(self, message: str, group: str, rank: int | None, method: str) -> None:
        super().__init__(message)
        self.group, self.rank, self.method = group, rank, method

    def __reduce__(self) -> tuple:  # raised in a worker, read in the controller: pickled with its fields
        return type(self), (str(self), self.group, self.rank, self.method)


class Receivers(Protocol):
    """The receiving workers as a cross-process sender sees them (over Ray: workers/transfer_choice.py)."""

    group: str  # their name in errors

    def start(self, method: str, *args: Any) -> None:
        """Start `method(*args)` on every receiver without waiting."""

    def wait(self, timeout_s: float | None = None) -> list[Any]:
        """The results in rank order; TransferError names a receiver that failed, TransferTimeout one
        that did not answer."""


def tensor_bytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def iter_buckets(named_tensors: Iterable[NamedTensor], bucket_bytes: int) -> Iterator[list[NamedTensor]]:
    """Consecutive buckets of at most `bucket_bytes`, in order; a larger tensor travels alone."""
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
class TransferStats:
    """One transfer: what moved and how fast. `weight_version` is the receivers' version after it."""

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


class WeightTransfer(ABC):
    def __init__(self, bucket_mb: float = 512, dtype: torch.dtype | None = None) -> None:
        if bucket_mb <= 0:
            raise ValueError(f"bucket_mb must be positive, got {bucket_mb}")
        self.bucket_bytes = int(bucket_mb * 1024 * 1024)
        self.dtype = dtype  # the receivers' dtype for floating tensors; None: as they come
        self.last: TransferStats | None = None

    def begin(self) -> None:
        """Open one transfer (a strategy may tell its receivers to listen)."""
        return None

    @abstractmethod
    def send(self, bucket: list[NamedTensor]) -> None:
        """Move one bucket; the receivers apply it by name."""

    @abstractmethod
    def finish(self) -> int:
        """Close the transfer: the receivers bump their weight version, returned here."""

    def abort(self, error: BaseException) -> BaseException:
        """The error to raise when a transfer failed midway (a strategy names the worker at fault)."""
        return error

    def close(self) -> None:
        """Let the receivers go (their group replaced), never waiting on one that may be dead."""
        return None

    def transfer(self, named_tensors: Iterable[NamedTensor]) -> TransferStats:
        """One whole transfer of `named_tensors` (all of the model's, or a named subset), measured."""
        start = time.perf_counter()
        total = buckets = tensors = largest = 0
        self.begin()
        try:
            for bucket in iter_buckets(self._cast(named_tensors), self.bucket_bytes):
                size = sum(tensor_bytes(t) for _, t in bucket)
                self.send(bucket)
                total, buckets, tensors = total + size, buckets + 1, tensors + len(bucket)
                largest = max(largest, size)
                del bucket  # let the bucket's tensors go before the next one is gathered
            version = self.finish()
        except Exception as exc:
            raise self.abort(exc) from exc
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.last = TransferStats(total, time.perf_counter() - start, buckets, tensors, largest, version)
        return self.last

    def _cast(self, named_tensors: Iterable[NamedTensor]) -> Iterator[NamedTensor]:
        for name, tensor in named_tensors:
            if self.dtype is not None and tensor.is_floating_point() and tensor.dtype != self.dtype:
                tensor = tensor.to(self.dtype)
            yield name, tensor
