"""The object-store strategy: each bucket is one object in Ray's object store, read by every
rollout worker.

A bucket is put once as uint8 numpy views of its tensors' bytes (no packing copy; receivers on the
node map it without deserialising), bit for bit. The next bucket is put while the receivers apply
the previous one, and the last bucket's call also closes the update.
"""

from __future__ import annotations

import warnings
from typing import Any

import ray
import torch

from engines.transfer.base import NamedTensor, WeightTransfer
from workers.transfer_peers import RolloutPeers

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
    name = "object_store"

    def __init__(
        self, receivers: RolloutPeers, bucket_mb: float = 512, dtype: torch.dtype | None = None
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
