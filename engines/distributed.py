"""Device, dtype and process-group set-up for the engines: gloo on CPU, NCCL (plus gloo for CPU tensors) on CUDA.

A process started by hand (a test, a benchmark) gets a single-rank group on a free local port.
"""

from __future__ import annotations

import os
import socket
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("engine device 'cuda' was asked for but torch sees no CUDA device")
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    return torch.device("cpu")


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(dtype: str | torch.dtype | None, device: str) -> torch.dtype:
    """'auto' (or None): bfloat16 on CUDA, float32 on CPU."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype in (None, "auto"):
        return torch.bfloat16 if device.startswith("cuda") else torch.float32
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype '{dtype}': choose 'auto' or one of {sorted(DTYPES)}")
    return DTYPES[dtype]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


_own_port: str | None = None  # the port this process chose for its single-rank group, if it did
JOIN_TIMEOUT_S = 600.0  # the start's collectives: ranks on several nodes may load their models minutes apart


def init_distributed(device: torch.device, timeout_s: float = JOIN_TIMEOUT_S) -> None:
    global _own_port
    if dist.is_initialized():
        return
    if "MASTER_ADDR" not in os.environ or os.environ.get("MASTER_PORT") == _own_port:
        # A port of its own at every start: one chosen for an earlier group (destroyed since) may
        # have been taken by another process in between. A rendezvous set by someone else is kept.
        os.environ.setdefault("RANK", "0")
        os.environ.setdefault("WORLD_SIZE", "1")
        os.environ["MASTER_ADDR"] = "127.0.0.1"
        _own_port = os.environ["MASTER_PORT"] = str(_free_port())
    if device.type == "cuda":
        torch.cuda.set_device(device)
        backend = "cpu:gloo,cuda:nccl"  # gloo too: offloaded (CPU) tensors are gathered as well
    else:
        backend = "gloo"
    dist.init_process_group(
        backend=backend,
        rank=int(os.environ["RANK"]),
        world_size=int(os.environ["WORLD_SIZE"]),
        timeout=timedelta(seconds=timeout_s),
    )


def set_collective_timeout(timeout_s: float) -> None:
    """Collectives from now on fail after `timeout_s`; every rank first waits here for the others, so a
    rank that started late is not taken for a hung one."""
    if dist.get_world_size() > 1:
        dist.barrier()
    # torch's one way to change a started group's timeout (torchtitan shortens it after the start too).
    dist.distributed_c10d._set_pg_timeout(timedelta(seconds=timeout_s))


def data_parallel_mesh(device: torch.device) -> DeviceMesh:
    return init_device_mesh(device.type, (dist.get_world_size(),), mesh_dim_names=("dp",))


def all_reduce(values: list[float], device: torch.device, op: str = "sum") -> list[float]:
    """Sum (op "max": the maximum of) a few numbers over all ranks, in float64 so counts stay exact."""
    values = [float(v) for v in values]
    if dist.get_world_size() == 1:  # a collective of one rank returns its input; skip gloo
        return values
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM)
    return tensor.tolist()
