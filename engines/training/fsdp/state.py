"""Checkpoints and Hugging Face exports of an FSDPEngine (engines/training/fsdp/engine.py), as a mixin.

Checkpoints go through torch's distributed state-dict API (`dcp`), so they load across world sizes,
wrapped or not; each rank adds its RNG state, rank 0 the schedule and the skipped-step count. With
LoRA a checkpoint holds the adapters and their optimizer state, and an export is a PEFT adapter folder.
A folder is written as `<path>.tmp`, then swapped in (the previous one renamed `<path>.old` until the
new one is in place), so a crash leaves one loadable: `resolve_checkpoint` falls back to `.old`.
"""

from __future__ import annotations

import json
import random
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)

from engines.training.fsdp import lora
from engines.training.fsdp.checkpoint_reader import load_torch_file, reading
from engines.training.fsdp.modules import PolicyModel

META_FILE = "engine_meta.json"
FORMAT_VERSION = 1
# Files of a model folder that are weights; everything else (tokenizer, templates) is copied on export.
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".index.json")


@contextmanager
def atomic_folder(path: str | Path, is_writer: bool, barrier: Callable[[], None]) -> Iterator[Path]:
    """Yield a temporary folder that replaces `path` only once every rank has finished writing."""
    final = Path(path)
    tmp, old = final.with_name(final.name + ".tmp"), final.with_name(final.name + ".old")
    if is_writer:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    barrier()
    yield tmp
    barrier()
    if is_writer:
        if final.exists():
            shutil.rmtree(old, ignore_errors=True)
            final.rename(old)
        tmp.rename(final)
        shutil.rmtree(old, ignore_errors=True)
    barrier()


def resolve_checkpoint(path: str | Path) -> Path:
    """The folder to load: `path`, or `<path>.old` if a crash interrupted the swap."""
    final = Path(path)
    if (final / META_FILE).exists():
        return final
    old = final.with_name(final.name + ".old")
    if (old / META_FILE).exists():
        return old
    raise FileNotFoundError(f"no complete checkpoint at '{path}' (missing {META_FILE})")


def rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def write_meta(folder: Path, meta: dict) -> None:
    (folder / META_FILE).write_text(json.dumps({"format_version": FORMAT_VERSION, **meta}, indent=2))


def copy_tokenizer_files(source: str | Path, dest: Path) -> None:
    """Copy everything of a model folder that is not weights or config (tokenizer, chat template)."""
    for item in Path(source).iterdir():
        if (
            item.is_file()
            and not item.name.endswith(_WEIGHT_SUFFIXES)
            and item.name not in ("config.json", "tandem_spec.json")
        ):
            shutil.copy2(item, dest / item.name)


class CheckpointMixin:
    """save_checkpoint / load_checkpoint / export_hf of the TrainEngine contract (engines/training/base.py),
    over the engine's `model`, `optimizer`, `scheduler`, `config`, `dp_rank`, `adapted_modules`."""

    def _state_options(self) -> StateDictOptions:
        # LoRA: the adapters and their optimizer state; the frozen base is the model folder's.
        return StateDictOptions(
            ignore_frozen_params=bool(self.adapted_modules), strict=not self.adapted_modules
        )

    def _state(self, with_optimizer: bool = True) -> dict:
        options = self._state_options()
        if self.optimizer is None or not with_optimizer:
            return {"model": get_model_state_dict(self.model, options=options)}
        model_state, optim_state = get_state_dict(self.model, self.optimizer, options=options)
        return {"model": model_state, "optim": optim_state}

    def save_checkpoint(self, path: str, step: int) -> None:
        self._onload(optimizer=self.optimizer is not None)
        with atomic_folder(path, self.dp_rank == 0, dist.barrier) as folder:
            dcp.save(self._state(), checkpoint_id=str(folder))
            torch.save(rng_state(), folder / f"rng_rank{self.dp_rank}.pt")
            if self.dp_rank == 0:
                extra = {"scheduler": self.scheduler.state_dict() if self.scheduler else None}
                torch.save({**extra, "skipped_steps": self.skipped_steps}, folder / "trainer_state.pt")
                write_meta(folder, {"step": step, "dp_size": self.dp_size, "role": self.config.role})
        self._offload_as_configured()

    def load_checkpoint(self, path: str, optimizer: bool = True) -> int:
        folder = resolve_checkpoint(path)
        with reading(folder / META_FILE):
            step = int(json.loads((folder / META_FILE).read_text())["step"])
        with_optimizer = optimizer and self.optimizer is not None
        self._onload(optimizer=with_optimizer)
        state = lora.load_checkpoint_state(self._state(with_optimizer), folder)  # PEFT's names too
        optimizers = self.optimizer if with_optimizer else ()
        set_state_dict(
            self.model,
            optimizers,
            model_state_dict=state["model"],
            optim_state_dict=state.get("optim", {}),
            options=self._state_options(),
        )
        if with_optimizer:
            with reading(folder / "trainer_state.pt"):
                extra = load_torch_file(folder / "trainer_state.pt")
                if self.scheduler is not None and extra["scheduler"] is not None:
                    self.scheduler.load_state_dict(extra["scheduler"])
                self.skipped_steps = int(extra["skipped_steps"])
        rng_file = folder / f"rng_rank{self.dp_rank}.pt"
        if rng_file.exists():
            with reading(rng_file):
                set_rng_state(load_torch_file(rng_file, rng=True))
        self._offload_as_configured()
        return step

    def export_hf(self, path: str, merged: bool = False) -> None:
        """Write the full weights as a Hugging Face folder that `from_pretrained` loads (policy only);
        with LoRA, a PEFT adapter folder (and, `merged`, the merged model under `path/merged`)."""
        if self.config.role != "policy":
            raise ValueError("export_hf writes causal LMs; a value model has no HF causal-LM form")
        self._onload(optimizer=False)
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        full = get_model_state_dict(self.model, options=options)
        with atomic_folder(path, self.dp_rank == 0, dist.barrier) as folder:
            if self.dp_rank == 0:
                state = {PolicyModel.hf_name(k): v for k, v in full.items()}
                if self.adapted_modules:  # a PEFT adapter folder, and the merged model beside it
                    adapter = {lora.peft_name(k): v for k, v in state.items() if lora.is_adapter(k)}
                    lora.write_adapter(folder, adapter, self.adapter_config())
                    if merged:
                        (folder / "merged").mkdir()
                        self._write_hf(folder / "merged", lora.merged_state(state, self.config.lora.scaling))
                else:
                    self._write_hf(folder, state)
                kind = "lora_export" if self.adapted_modules else "hf_export"
                write_meta(folder, {"step": -1, "kind": kind})
        self._offload_as_configured()

    def _write_hf(self, folder: Path, tensors: dict[str, torch.Tensor]) -> None:
        """A Hugging Face folder: the weights (a tied output projection left out), config, tokenizer."""
        from safetensors.torch import save_file

        if getattr(self.hf_config, "tie_word_embeddings", False):
            tensors.pop("lm_head.weight", None)
        tensors = {k: v.contiguous() for k, v in tensors.items()}
        save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
        self.hf_config.save_pretrained(folder)
        copy_tokenizer_files(self.config.model_path, folder)
