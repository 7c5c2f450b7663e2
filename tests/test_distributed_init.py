"""A process's own single-rank group takes a fresh port at every start (engines/distributed.py)."""

from __future__ import annotations

import os
import socket

import torch
import torch.distributed as dist

from engines.distributed import init_distributed


def test_a_group_started_again_does_not_reuse_a_port_taken_since(monkeypatch):
    for key in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    if dist.is_initialized():
        dist.destroy_process_group()
    init_distributed(torch.device("cpu"))
    first = int(os.environ["MASTER_PORT"])
    dist.destroy_process_group()
    with socket.socket() as taken:  # another process's socket on the port the first group used
        taken.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        taken.bind(("127.0.0.1", first))
        taken.listen()
        init_distributed(torch.device("cpu"))  # was EADDRINUSE: the old port came from the environment
        try:
            assert int(os.environ["MASTER_PORT"]) != first and dist.get_world_size() == 1
        finally:
            dist.destroy_process_group()
