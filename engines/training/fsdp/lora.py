"""LoRA on the FSDP engine, and the PEFT adapter format in and out.

`attach` wraps each target linear layer in place (engines/training/multi_lora.py, no PeftModel, so
the engine's modules and FSDP units stay as they are), gives it its own adapter with PEFT's targets
and initialisation, and freezes the rest. Tensors cross the engine boundary under PEFT's saved names
(`base_model.model.<module>.lora_A.weight`) with PEFT's `adapter_config.json`, as vLLM reads them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from engines.training.lora_targets import ADAPTER_CONFIG, ADAPTER_FILE, PEFT_PREFIX, adapter_file, base_module
from engines.training.multi_lora import from_peft_tensors, inject
from schema.engine import ALL_LINEAR, LoraConfig


def peft_config(cfg: LoraConfig, base_model_path: str | None = None):  # -> peft.LoraConfig
    from peft import LoraConfig as PeftLoraConfig

    targets = ALL_LINEAR if cfg.target_modules == ALL_LINEAR else list(cfg.target_modules)
    return PeftLoraConfig(
        r=cfg.rank,
        lora_alpha=cfg.alpha,
        lora_dropout=cfg.dropout,
        target_modules=targets,
        bias="none",
        task_type="CAUSAL_LM",
        base_model_name_or_path=base_model_path,
    )


def is_adapter(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


def target_paths(lm: nn.Module, cfg: LoraConfig) -> list[str]:
    """The linear layers `cfg.target_modules` names, in module order (the order PEFT adds adapters
    in, so the same draws initialise the same layers), as PEFT matches them: 'all-linear' is every
    linear layer but the output projection; a name matches a path equal to it or ending in '.name'."""
    head = lm.get_output_embeddings() if hasattr(lm, "get_output_embeddings") else None
    linear = [(name, m) for name, m in lm.named_modules() if isinstance(m, nn.Linear)]
    if cfg.target_modules == ALL_LINEAR:
        return [name for name, m in linear if m is not head]
    names = cfg.target_modules
    paths = [(n, m) for n, m in linear if any(n == t or n.endswith(f".{t}") for t in names)]
    if any(m is head for _, m in paths):
        # The policy's log-probs read the output projection's weight directly (modules.PolicyModel),
        # so an adapter there would get no gradient and silently train nothing.
        raise ValueError("model.lora.target_modules: the output projection cannot take an adapter")
    if not paths:
        raise ValueError(f"model.lora.target_modules: no linear layer of this model is named {names}")
    return [name for name, _ in paths]


def attach(lm: nn.Module, cfg: LoraConfig) -> list[str]:
    """Give each target layer of `lm` its own adapter (in place) and freeze the base; returns the
    adapted module paths."""
    paths = target_paths(lm, cfg)
    layers = inject(lm, paths)
    for path in paths:
        layers[path].add_own(cfg.rank, cfg.scaling, cfg.dropout)
    for name, param in lm.named_parameters():
        param.requires_grad_(is_adapter(name))
    return sorted(paths)


def load_adapter_weights(lm: nn.Module, init_from: str) -> int:
    """Copy a PEFT adapter's tensors (folder or bare safetensors) into the injected layers; returns
    how many. Shapes were checked at submission; a mismatch here is still an error, never a skip."""
    from safetensors.torch import load_file

    params = dict(lm.named_parameters())
    loaded = 0
    for name, tensor in load_file(str(adapter_file(Path(init_from)))).items():
        parsed = base_module(name)
        if parsed is None:
            continue
        module, part = parsed
        target = params.get(f"{module}.lora_{part}.weight")
        if target is None or target.shape != tensor.shape:
            raise ValueError(
                f"model.lora.init_from: '{name}' {list(tensor.shape)} has no matching adapter in this model "
                f"({'no such layer' if target is None else list(target.shape)})"
            )
        with torch.no_grad():
            target.copy_(tensor)
        loaded += 1
    return loaded


def peft_name(engine_name: str) -> str:
    """'model.layers.0.q_proj.lora_A.weight' -> 'base_model.model.model.layers.0.q_proj.lora_A.weight'."""
    return PEFT_PREFIX + engine_name


def adapter_config_dict(cfg: LoraConfig, base_model_path: str, modules: list[str]) -> dict:
    """PEFT's adapter_config.json for this adapter, with the resolved target module names (vLLM
    needs explicit names, not 'all-linear')."""
    config = peft_config(cfg, base_model_path).to_dict()
    config["target_modules"] = sorted({m.rsplit(".", 1)[-1] for m in modules})
    for key, value in list(config.items()):
        if isinstance(value, set):
            config[key] = sorted(value)
    return config


def write_adapter(folder: Path, tensors: dict[str, torch.Tensor], config: dict) -> None:
    """An adapter folder in PEFT's format: adapter_config.json and adapter_model.safetensors."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    save_file(
        {k: v.detach().contiguous().cpu() for k, v in tensors.items()},
        str(folder / ADAPTER_FILE),
        metadata={"format": "pt"},
    )
    (folder / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2, default=str))


def merged_state(state: dict[str, torch.Tensor], scaling: float) -> dict[str, torch.Tensor]:
    """An adapted model's full state dict (HF names, with `.base_layer.` and LoRA entries) as the
    plain model's: every adapted layer's weight is W + scaling * B @ A."""
    out = {k.replace(".base_layer.", "."): v for k, v in state.items() if not is_adapter(k)}
    for module, (a, b) in from_peft_tensors({k: v for k, v in state.items() if is_adapter(k)}).items():
        key = f"{module}.weight"
        out[key] = (out[key].double() + scaling * (b.double() @ a.double())).to(out[key].dtype)
    return out


def _peft_layer_names(obj: Any, to_peft: bool) -> Any:
    """A (nested) state dict whose adapter names, keys and strings alike, go to or from PEFT's
    layer naming, which called a model's one adapter 'default' ('...lora_A.default.weight')."""
    if isinstance(obj, str):
        for part in "AB":
            ours, peft = f".lora_{part}.", f".lora_{part}.default."
            obj = obj.replace(ours, peft) if to_peft else obj.replace(peft, ours)
        return obj
    if isinstance(obj, dict):
        return {_peft_layer_names(k, to_peft): _peft_layer_names(v, to_peft) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_peft_layer_names(v, to_peft) for v in obj]
    return obj


def load_checkpoint_state(state: dict, folder: Path) -> dict:
    """`state` loaded from the checkpoint `folder` (torch's distributed checkpoint). A LoRA checkpoint
    written while RL jobs ran PEFT's layers names its adapters as those did: it is read under those
    names, then renamed back; tensors load in place, other values come back in the returned dict."""
    from engines.training.fsdp.checkpoint_reader import CheckpointError, SafeReader, load_state

    saved = SafeReader(str(folder)).read_metadata().state_dict_metadata
    peft = any(".lora_A.default." in name for name in saved)
    wanted = _peft_layer_names(state, to_peft=True) if peft else state
    # A weight the job's model lacks would be dropped silently: the resumed model would not be the saved one.
    unused = sorted({k for k in saved if k.startswith("model.")} - {f"model.{k}" for k in wanted["model"]})
    if unused:
        raise CheckpointError(f"checkpoint {folder} holds {len(unused)} weights this job's model lacks, e.g. "
                              f"'{unused[0]}': its model or model.lora (rank, target_modules) differ")  # fmt: skip
    load_state(wanted, folder)
    return _peft_layer_names(wanted, to_peft=False) if peft else state
