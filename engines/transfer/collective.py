"""The collective strategy: weights broadcast over a torch.distributed group made for the transfer.

The group (sender rank 0, rollout workers 1..N) has its own TCPStore rendezvous and process-group
object, gloo on CPU, NCCL on GPU, so neither side's default group is touched. Each bucket is one
flat byte buffer (one broadcast rather than one per tensor; the receiver cuts it into views, bit for
bit) in three broadcasts: sizes, pickled header, bytes; an empty header ends the transfer.
"""

from __future__ import annotations

import math
import pickle
from collections.abc import Iterator
from datetime import timedelta

import torch
import torch.distributed as dist

from engines.transfer.base import (
    NamedTensor,
    Receivers,
    TransferError,
    TransferTimeout,
    WeightTransfer,
    tensor_bytes,
)

Header = list[tuple[str, str, tuple[int, ...], int]]  # (name, dtype, shape, byte offset)
ABORT_GRACE_S = 30.0  # a failed broadcast waits at most this long for the receivers to say which failed


def peer_failure(error: BaseException) -> bool:
    """Whether a collective's error reads as its peers' doing (one timed out, closed or reset the
    connection) rather than the caller's own (out of memory, a bad dtype)."""
    text = str(error).lower()
    return isinstance(error, dist.DistError) or any(
        words in text for words in ("timed out", "timeout", "connection", "peer", "broken pipe", "nccl")
    )


ALIGN = 64  # every tensor starts on a 64-byte boundary: viewable as any dtype, and copied at full speed


def pack(bucket: list[NamedTensor], buffer: torch.Tensor | None = None) -> tuple[Header, torch.Tensor]:
    """(header, flat uint8 tensor on the bucket's device); written into `buffer` when it is large
    enough (fresh pages cost a fault each, on CPU about as much as the copy)."""
    header: Header = []
    offset = 0
    for name, t in bucket:
        offset = -(-offset // ALIGN) * ALIGN
        header.append((name, str(t.dtype).removeprefix("torch."), tuple(t.shape), offset))
        offset += tensor_bytes(t)
    if buffer is not None and buffer.numel() >= offset and buffer.device == bucket[0][1].device:
        flat = buffer[:offset]
    else:
        flat = torch.empty(offset, dtype=torch.uint8, device=bucket[0][1].device)
    for (_, t), (_, _, _, start) in zip(bucket, header, strict=True):
        flat[start : start + tensor_bytes(t)].view(t.dtype).view(t.shape).copy_(t.detach())
    return header, flat


def unpack(header: Header, flat: torch.Tensor) -> list[NamedTensor]:
    """The bucket again, as views into `flat` (keep `flat` alive while they are used)."""
    out, end = [], 0
    for name, dtype, shape, start in header:
        dt = getattr(torch, dtype)
        end = start + dt.itemsize * math.prod(shape)
        if end > flat.numel():
            break
        out.append((name, flat[start:end].view(dt).view(shape)))
    if end != flat.numel():
        raise ValueError(f"a weight bucket of {flat.numel()} bytes does not match its header ({end} bytes)")
    return out


class TransferGroup:
    def __init__(
        self, store: dist.Store, rank: int, world: int, backend: str, timeout_s: float, name: str = ""
    ) -> None:
        self.rank, self.world, self.backend, self.timeout_s = rank, world, backend, timeout_s
        self.name = name or f"weight-transfer({backend}, {world} ranks)"
        self.device = (
            torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
        )
        timeout = timedelta(seconds=timeout_s)
        prefixed = dist.PrefixStore("weight-transfer", store)
        if backend == "gloo":
            self.pg: dist.ProcessGroup = dist.ProcessGroupGloo(prefixed, rank, world, timeout)
        elif backend == "nccl":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            self.pg = dist.ProcessGroupNCCL(prefixed, rank, world, options)
        else:
            raise ValueError(f"unknown transfer backend '{backend}': use 'gloo' or 'nccl'")
        self._store = store  # the sender's store must outlive the group
        self._buffer = torch.empty(0, dtype=torch.uint8, device=self.device)  # reused across buckets

    @staticmethod
    def host_store(host: str, world: int, timeout_s: float) -> tuple[dist.TCPStore, int]:
        """The sender's rendezvous store on a free port of its own; returns it and the port."""
        store = dist.TCPStore(
            host, 0, world, is_master=True, timeout=timedelta(seconds=timeout_s), wait_for_workers=False
        )
        return store, store.port

    @classmethod
    def join(
        cls, host: str, port: int, rank: int, world: int, backend: str, timeout_s: float
    ) -> TransferGroup:
        """A receiver's side: join the sender's store and build the group (blocks until all join)."""
        store = dist.TCPStore(host, port, world, is_master=False, timeout=timedelta(seconds=timeout_s))
        return cls(store, rank, world, backend, timeout_s)

    def close(self) -> None:
        """Abort the group without waiting for its peers (one may be dead), and drop the store."""
        try:
            self.pg.abort()
        except Exception:  # a backend without abort, or one already broken: dropping it is enough
            pass
        del self.pg
        self._store = None

    def broadcast(self, tensor: torch.Tensor) -> None:
        """Rank 0's `tensor` into everyone's, in place; bounded by the group's timeout."""
        options = dist.BroadcastOptions()
        options.rootRank = 0
        self.pg.broadcast([tensor], options).wait(timedelta(seconds=self.timeout_s))

    def send_bucket(self, bucket: list[NamedTensor] | None) -> None:
        """Rank 0: one bucket (None: the end of the transfer)."""
        header, flat = pack(bucket, self._buffer) if bucket else (None, None)
        if flat is not None and flat.device == self.device and flat.data_ptr() != self._buffer.data_ptr():
            self._buffer = flat  # the first bucket of this size: keep its buffer for the next ones
        data = torch.frombuffer(bytearray(pickle.dumps(header)), dtype=torch.uint8).to(self.device)
        payload = 0 if flat is None else flat.numel()
        self.broadcast(torch.tensor([data.numel(), payload], dtype=torch.int64, device=self.device))
        self.broadcast(data)
        if flat is not None:
            self.broadcast(flat.to(self.device))

    def receive_buckets(self) -> Iterator[list[NamedTensor]]:
        """Ranks 1..: the buckets of one transfer, until its end mark, each as views into this rank's
        reused buffer: apply (copy out) one before asking for the next."""
        while True:
            sizes = torch.empty(2, dtype=torch.int64, device=self.device)
            self.broadcast(sizes)
            data = torch.empty(int(sizes[0]), dtype=torch.uint8, device=self.device)
            self.broadcast(data)
            header: Header | None = pickle.loads(data.cpu().numpy().tobytes())
            if header is None:
                return
            if self._buffer.numel() < int(sizes[1]):
                self._buffer = torch.empty(int(sizes[1]), dtype=torch.uint8, device=self.device)
            flat = self._buffer[: int(sizes[1])]
            self.broadcast(flat)
            yield unpack(header, flat)


class CollectiveTransfer(WeightTransfer):
    def __init__(
        self,
        group: TransferGroup,
        receivers: Receivers,
        bucket_mb: float = 512,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(bucket_mb, dtype)
        self.group, self.receivers = group, receivers

    def begin(self) -> None:
        self.receivers.start("receive_weights")  # each receiver loops over buckets until the end mark

    def send(self, bucket: list[NamedTensor]) -> None:
        self.group.send_bucket(bucket)

    def finish(self) -> int:
        self.group.send_bucket(None)
        return int(self.receivers.wait()[0])

    def close(self) -> None:
        self.group.close()

    def abort(self, error: BaseException) -> BaseException:
        """A failed broadcast: the receivers' calls say which worker died, failed or stopped answering
        (a TransferTimeout); the error of the receivers' wait in `finish` already says so."""
        if isinstance(error, TransferError):
            return error
        if not peer_failure(error):  # the sender's own (out of memory, a bad dtype): receivers just wait
            return TransferError(f"weight transfer over {self.group.name} failed on the sender: {error}")
        try:
            # Receivers blocked in the same broadcast fail within moments of the sender, a dead one is
            # reported by Ray: half the limit keeps the sender's named error inside the sync call's.
            self.receivers.wait(timeout_s=min(self.group.timeout_s / 2, ABORT_GRACE_S))
        except TransferTimeout as silent:
            waited = f"{silent}, after the sender waited {self.group.timeout_s:g}s for it"
            return TransferTimeout(waited, silent.group, silent.rank, silent.method)
        except TransferError as named:
            return named
        return TransferError(f"weight transfer over {self.group.name} failed on the sender: {error}")
