"""How a LoRA adapter reaches vLLM in this process: a folder in RAM, loaded in place.

vLLM 0.32 loads adapters only from a folder (`LoRARequest.lora_path`, read by
`WorkerLoRAManager._load_adapter` through `LoRAModel.from_local_checkpoint`); it has no request type
that carries tensors (verl patches one in, `TensorLoRARequest`; patching vLLM's private loader is
what breaks on upgrades). So each sync writes the adapter, a few megabytes, to a folder under
/dev/shm (RAM: no disk write) and re-adds the same LoRA id with `load_inplace=True`, which replaces
the served adapter's weights; generate passes that request. On CPU the LoRA layers run
vllm/lora/punica_wrapper/punica_cpu.py's kernels, in this process like the rest of the engine.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from engines.fsdp.lora import write_adapter

LORA_ID = 1  # one adapter per engine: the job's


def ram_folder() -> Path:
    """A private folder in RAM when the machine has /dev/shm, else in the temp folder."""
    root = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
    return Path(tempfile.mkdtemp(prefix="tandem-lora-", dir=root))


class AdapterFolder:
    """The RAM folder holding the adapter vLLM serves, and the request that names it."""

    def __init__(self) -> None:
        self.folder = ram_folder()
        self.request: Any = None

    def write(self, config: dict, named_tensors: list[tuple[str, torch.Tensor]]) -> None:
        from vllm.lora.request import LoRARequest

        write_adapter(self.folder, dict(named_tensors), config)
        self.request = LoRARequest("tandem", LORA_ID, str(self.folder), load_inplace=True)

    def remove(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)
