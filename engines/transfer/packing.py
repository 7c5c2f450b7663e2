"""A bucket of named tensors as one flat byte tensor plus a header, and back, bit for bit.

One buffer per bucket rather than a message per tensor; the receiver cuts it into views, no copy.
"""

from __future__ import annotations

import math
import pickle

import torch

from engines.transfer.base import NamedTensor

Header = list[tuple[str, str, tuple[int, ...], int]]  # (name, dtype, shape, byte offset)
ALIGN = 64  # every tensor starts on a 64-byte boundary: viewable as any dtype, and copied at full speed


def pack(bucket: list[NamedTensor], buffer: torch.Tensor | None = None) -> tuple[Header, torch.Tensor]:
    """(header, flat uint8 tensor on the bucket's device); written into `buffer` when it is large
    enough (fresh pages cost a fault each, on CPU about as much as the copy)."""
    header: Header = []
    offset = 0
    for name, t in bucket:
        offset = -(-offset // ALIGN) * ALIGN
        header.append((name, str(t.dtype).removeprefix("torch."), tuple(t.shape), offset))
        offset += t.numel() * t.element_size()
    if buffer is not None and buffer.numel() >= offset and buffer.device == bucket[0][1].device:
        flat = buffer[:offset]
    else:
        flat = torch.empty(offset, dtype=torch.uint8, device=bucket[0][1].device)
    for (_, t), (_, _, _, start) in zip(bucket, header, strict=True):
        nbytes = t.numel() * t.element_size()
        flat[start : start + nbytes].view(t.dtype).view(t.shape).copy_(t.detach())
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


def encode_header(header: Header | None, device: torch.device) -> torch.Tensor:
    """The header as uint8 bytes (None: the end of a transfer), for a collective to carry."""
    return torch.frombuffer(bytearray(pickle.dumps(header)), dtype=torch.uint8).to(device)


def decode_header(data: torch.Tensor) -> Header | None:
    return pickle.loads(data.cpu().numpy().tobytes())
