"""A bucket of named tensors as one flat byte tensor plus a small header, and back, bit for bit.

The cross-process strategies move a bucket as one buffer (one broadcast, or one object-store
object) rather than a message per tensor; the header lists (name, dtype, shape) in order, so the
receiver cuts the buffer into views without a copy. Any dtype travels (bfloat16 included): the
bytes are reinterpreted, never converted.
"""

from __future__ import annotations

import pickle

import torch

from engines.transfer.base import NamedTensor

Header = list[tuple[str, str, tuple[int, ...]]]


def pack(bucket: list[NamedTensor]) -> tuple[Header, torch.Tensor]:
    """(header, flat uint8 tensor on the bucket's device) for `bucket`."""
    header = [(name, str(t.dtype).removeprefix("torch."), tuple(t.shape)) for name, t in bucket]
    flat = torch.cat([t.detach().contiguous().reshape(-1).view(torch.uint8) for _, t in bucket])
    return header, flat


def unpack(header: Header, flat: torch.Tensor) -> list[NamedTensor]:
    """The bucket again, as views into `flat` (keep `flat` alive while they are used)."""
    out, offset = [], 0
    for name, dtype, shape in header:
        dt = getattr(torch, dtype)
        size = dt.itemsize
        for dim in shape:
            size *= dim
        out.append((name, flat[offset : offset + size].view(dt).view(shape)))
        offset += size
    if offset != flat.numel():
        raise ValueError(
            f"a weight bucket of {flat.numel()} bytes does not match its header ({offset} bytes)"
        )
    return out


def encode_header(header: Header | None, device: torch.device) -> torch.Tensor:
    """The header as uint8 bytes (None: the end of a transfer), for a collective to carry."""
    return torch.frombuffer(bytearray(pickle.dumps(header)), dtype=torch.uint8).to(device)


def decode_header(data: torch.Tensor) -> Header | None:
    return pickle.loads(data.cpu().numpy().tobytes())
