"""One adapter's state on a shared base: its weights, gradients and AdamW state (`Session`), resident on
the device or offloaded (packed into CPU tensors, in host memory or one file) and restored bit for bit;
saved as a folder: the adapter in PEFT's format, `optimizer.pt`, and `session.json` (its `SessionSpec`).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch.utils._pytree import tree_map

from engines.training.adamw import AdamWSettings, adamw_step, build_adamw
from engines.training.fsdp.lora import write_adapter
from engines.training.lora_targets import ADAPTER_FILE
from engines.training.multi_lora import from_peft_tensors, peft_tensors

SESSION_FILE = "session.json"
OPTIMIZER_FILE = "optimizer.pt"
Weights = dict[str, tuple[torch.Tensor, torch.Tensor]]
# Each step brings its own AdamParams; these only fill the optimizer's groups until the first one.
SDK_DEFAULTS = AdamWSettings.from_adam_params({})


@dataclass(frozen=True)
class SessionSpec:
    rank: int
    alpha: float
    seed: int
    paths: tuple[str, ...]  # the adapted linear layers, in order
    train_attn: bool = True
    train_mlp: bool = True
    train_unembed: bool = True

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank


class Session:
    def __init__(
        self,
        model_id: str,
        spec: SessionSpec,
        weights: Weights | None,
        device: torch.device,
        offloaded: dict | None = None,
    ) -> None:
        self.model_id, self.spec, self.device = model_id, spec, device
        self.weights = weights
        self.optimizer = None if weights is None else build_adamw(self.params(), SDK_DEFAULTS)
        # while not resident: the packed state (CPU tensors) in host memory, or the Path of its file
        self.offloaded: dict | Path | None = offloaded

    @property
    def resident(self) -> bool:
        return self.weights is not None

    def params(self) -> list[torch.Tensor]:
        assert self.weights is not None, f"session '{self.model_id}' is offloaded"
        return [t for path in self.spec.paths for t in self.weights[path]]

    def numel(self) -> int:
        return sum(p.numel() for p in self.params()) if self.resident else 0

    def offload(self, folder: Path | None) -> None:
        """Move everything to host memory, or to `folder/<model_id>.pt` when a folder is given."""
        packed = {
            "weights": _cpu(peft_tensors(self.weights)),
            "grads": [_cpu(p.grad) for p in self.params()],
            "optimizer": _cpu(self.optimizer.state_dict()),
        }
        self.weights, self.optimizer, self.offloaded = None, None, packed
        if folder is not None:
            folder.mkdir(parents=True, exist_ok=True)
            self.offloaded = folder / f"{_safe(self.model_id)}.pt"
            torch.save(packed, self.offloaded)

    def discard(self) -> None:
        if isinstance(self.offloaded, Path):
            self.offloaded.unlink(missing_ok=True)

    def restore(self) -> None:
        packed = self.offloaded
        if isinstance(packed, Path):
            packed = torch.load(packed, weights_only=True)
        self.discard()
        weights = from_peft_tensors(packed["weights"])
        self.weights = {
            path: tuple(t.to(self.device).clone().requires_grad_(True) for t in weights[path])
            for path in self.spec.paths
        }
        params = self.params()
        for param, grad in zip(params, packed["grads"] or [None] * len(params), strict=True):
            param.grad = grad.to(self.device).clone() if grad is not None else None
        self.optimizer = build_adamw(params, SDK_DEFAULTS)
        if packed["optimizer"] is not None:
            self.optimizer.load_state_dict(packed["optimizer"])
        self.offloaded = None

    def optim_step(self, settings: AdamWSettings) -> float:
        """One AdamW step (engines/training/adamw.py) of this adapter with this call's settings; its grad norm."""
        return adamw_step(self.optimizer, self.params(), settings, override=True)

    def save(self, folder: Path, adapter_config: dict, optimizer: bool) -> None:
        write_adapter(folder, peft_tensors(self.weights), adapter_config)
        (folder / SESSION_FILE).write_text(json.dumps(asdict(self.spec), indent=2))
        opt_file = folder / OPTIMIZER_FILE
        if optimizer:
            torch.save(_cpu(self.optimizer.state_dict()), opt_file)
        else:
            opt_file.unlink(missing_ok=True)


def read_spec(folder: Path) -> SessionSpec:
    raw = json.loads((folder / SESSION_FILE).read_text())
    return SessionSpec(**{**raw, "paths": tuple(raw["paths"])})


def read_pack(folder: Path, optimizer: bool) -> dict:
    """A saved folder as `Session.restore` reads it (no gradients: a save is taken between steps)."""
    from safetensors.torch import load_file

    opt_file = folder / OPTIMIZER_FILE
    if optimizer and not opt_file.is_file():
        raise FileNotFoundError(f"'{folder}' was saved without optimizer state")
    return {
        "weights": load_file(str(folder / ADAPTER_FILE)),
        "grads": None,
        "optimizer": torch.load(opt_file, weights_only=True) if optimizer else None,
    }


def _cpu(obj: Any) -> Any:
    """CPU copies of the tensors in `obj` (nested dicts and lists); other values as they are."""
    return tree_map(lambda t: t.detach().cpu().clone() if isinstance(t, torch.Tensor) else t, obj)


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name)
