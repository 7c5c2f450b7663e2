"""A LoRA spec checked against its base model without torch (the API runs these at submission), from the
safetensors headers of the model folder and of an adapter: the targets exist, and A is [rank, in] and B
[out, rank] on each adapted layer. A built-in model not built yet has every Llama decoder's layers.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

from schema.engine import ALL_LINEAR, LoraConfig

# The linear layers of every Llama-family decoder (llama, qwen2, mistral, smollm2, the tiny models).
LLAMA_LINEAR = ("down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj")
ADAPTER_FILE = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
PEFT_PREFIX = "base_model.model."
Shapes = dict[str, tuple[int, ...]]


def safetensors_shapes(path: Path) -> Shapes:
    """Tensor name -> shape, read from a safetensors file's header (8-byte length, then JSON)."""
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        if length > 100_000_000:
            raise ValueError(f"'{path.name}' is not a safetensors file (header of {length} bytes)")
        header = json.loads(f.read(length))
    return {name: tuple(info["shape"]) for name, info in header.items() if name != "__metadata__"}


def model_shapes(folder: Path) -> Shapes:
    """Every tensor of a Hugging Face model folder (one file or shards)."""
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ValueError(f"model folder '{folder}' has no safetensors weights")
    out: Shapes = {}
    for file in files:
        out.update(safetensors_shapes(file))
    return out


def linear_layers(folder: Path) -> Shapes:
    """Module path -> [out, in] of the linear layers LoRA can adapt: 2-D weights, not the embedding
    or the output projection (both have a vocabulary-sized first dimension)."""
    vocab = json.loads((folder / "config.json").read_text()).get("vocab_size")
    return {
        name.removesuffix(".weight"): shape
        for name, shape in model_shapes(folder).items()
        if name.endswith(".weight") and len(shape) == 2 and shape[0] != vocab
    }


def llama_layers(hidden: int, intermediate: int, layers: int, heads: int, kv_heads: int) -> Shapes:
    """The linear layers of a Llama-family decoder of this shape (a built-in model not built yet)."""
    kv = hidden // heads * kv_heads
    shapes = {
        "self_attn.q_proj": (hidden, hidden),
        "self_attn.k_proj": (kv, hidden),
        "self_attn.v_proj": (kv, hidden),
        "self_attn.o_proj": (hidden, hidden),
        "mlp.gate_proj": (intermediate, hidden),
        "mlp.up_proj": (intermediate, hidden),
        "mlp.down_proj": (hidden, intermediate),
    }
    return {f"model.layers.{i}.{name}": shape for i in range(layers) for name, shape in shapes.items()}


def module_names(layers: Shapes) -> list[str]:
    """The short names (the last path component) of the layers, as target_modules names them."""
    return sorted({name.rsplit(".", 1)[-1] for name in layers})


def target_errors(lora: LoraConfig, names: list[str] | tuple[str, ...]) -> str | None:
    """Why `lora.target_modules` does not fit a model with linear layers `names`, or None."""
    if lora.target_modules == ALL_LINEAR:
        return None
    unknown = [m for m in lora.target_modules if m.rsplit(".", 1)[-1] not in names]
    if unknown:
        return (
            f"module '{unknown[0]}' is not a linear layer of this model; its linear layers are "
            f"{sorted(names)} (or give 'all-linear')"
        )
    return None


def adapter_file(init_from: Path) -> Path:
    return init_from / ADAPTER_FILE if init_from.is_dir() else init_from


def base_module(adapter_name: str) -> tuple[str, str] | None:
    """('model.layers.0.self_attn.q_proj', 'A') for a PEFT tensor name, None for another tensor."""
    name = adapter_name.removeprefix(PEFT_PREFIX)
    for part in ("A", "B"):
        for suffix in (f".lora_{part}.weight", f".lora_{part}.default.weight"):
            if name.endswith(suffix):
                return name.removesuffix(suffix), part
    return None


def other_base(init_from: Path, base_folder: Path | None) -> str | None:
    """Why the adapter's own config names another base model, or None (unknown counts as the same).

    Shapes alone cannot tell two bases of one architecture and size apart; the folder the adapter
    was trained on can, when its config.json is readable here."""
    config = init_from / ADAPTER_CONFIG if init_from.is_dir() else None
    if base_folder is None or config is None or not config.is_file():
        return None
    named = json.loads(config.read_text()).get("base_model_name_or_path")
    trained_on = Path(named) / "config.json" if named else None
    if trained_on is None or not trained_on.is_file() or not (base_folder / "config.json").is_file():
        return None
    keys = ("model_type", "vocab_size", "hidden_size", "num_hidden_layers", "intermediate_size")
    theirs, ours = json.loads(trained_on.read_text()), json.loads((base_folder / "config.json").read_text())
    differ = [k for k in keys if theirs.get(k) != ours.get(k)]
    if differ:
        return (
            f"the adapter was trained on '{named}', another base model ({differ[0]}: "
            f"{theirs.get(differ[0])} there, {ours.get(differ[0])} here)"
        )
    return None


def init_from_errors(
    lora: LoraConfig, init_from: Path, base: Shapes, base_folder: Path | None = None
) -> str | None:
    """Why the adapter at `init_from` does not fit this base and rank, or None."""
    file = adapter_file(init_from)
    if not file.is_file():
        return f"'{init_from}' holds no {ADAPTER_FILE}: not a PEFT adapter"
    why = other_base(init_from, base_folder)
    if why is not None:
        return why
    try:
        shapes = safetensors_shapes(file)
    except (OSError, ValueError, struct.error) as err:
        return f"'{file.name}' cannot be read as safetensors: {err}"
    found = 0
    for name, shape in shapes.items():
        parsed = base_module(name)
        if parsed is None:
            continue
        found += 1
        module, part = parsed
        if module not in base:
            return f"the adapter adapts '{module}', which this base model does not have: it was trained for another base"
        out_dim, in_dim = base[module]
        want = (lora.rank, in_dim) if part == "A" else (out_dim, lora.rank)
        if tuple(shape) != want:
            return (
                f"the adapter's '{name}' is {list(shape)}, but rank {lora.rank} on this base's '{module}' "
                f"[{out_dim}, {in_dim}] needs {list(want)}: another base, or model.lora.rank differs"
            )
    if not found:
        return f"'{file.name}' holds no LoRA tensors (lora_A / lora_B)"
    return None
