"""The object-store strategy: each bucket is one object in Ray's object store, read by every
rollout worker.

A bucket is packed into one flat byte array (engines/transfer/packing.py) and `ray.put` once as a
numpy array, so that every receiver on the node maps the same shared-memory copy without a
deserialising copy of its own; each receiver applies it by name (`RolloutWorker.receive_bucket`).
The next bucket is gathered and put while the receivers apply the previous one: at most two buckets
are held. `finish` asks every receiver to close the update and returns its weight version.
"""

from __future__ import annotations

import ray
import torch

from engines.transfer.base import NamedTensor, WeightTransfer
from engines.transfer.packing import pack
from workers.transfer_peers import RolloutPeers


class ObjectStoreTransfer(WeightTransfer):
    name = "object_store"

    def __init__(
        self, receivers: RolloutPeers, bucket_mb: float = 512, dtype: torch.dtype | None = None
    ) -> None:
        super().__init__(bucket_mb, dtype)
        self.receivers = receivers
        self._in_flight = False

    def begin(self) -> None:
        self._in_flight = False

    def send(self, bucket: list[NamedTensor]) -> None:
        header, flat = pack(bucket)
        ref = ray.put((header, flat.cpu().numpy()))
        if self._in_flight:
            self.receivers.wait()  # the previous bucket has landed everywhere
        self.receivers.start("receive_bucket", ref)
        self._in_flight = True

    def finish(self) -> int:
        if self._in_flight:
            self.receivers.wait()
            self._in_flight = False
        self.receivers.start("finish_transfer")
        return int(self.receivers.wait()[0])

    def abort(self, error: BaseException) -> BaseException:
        self._in_flight = False
        return error  # RolloutPeers.wait already named the receiver that failed
