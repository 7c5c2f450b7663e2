"""Where a job's model comes from: a local Hugging Face folder, or a built-in model (engines/models/tiny_models.py,
engines/models/pretrained.py) built on first use under `$TANDEM_HOME/models/<name>` (default ~/.tandem).
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

from engines.models.pretrained import PACKAGED_MODELS, build_packaged_model
from engines.models.tiny_models import BUILTIN_MODELS, build_builtin_model
from schema.job import ModelSpec

BUILTIN_MODEL_NAMES: tuple[str, ...] = tuple(sorted([*BUILTIN_MODELS, *PACKAGED_MODELS]))
_CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length")
_STRETCHING = ("linear", "dynamic", "yarn")  # rope scalings whose factor multiplies the positions
MAX_CONFIG_BYTES = 1 << 20  # a model's config.json is kilobytes; a larger one is not read


def tandem_home() -> Path:
    return Path(os.environ.get("TANDEM_HOME") or Path.home() / ".tandem").expanduser()


def builtin_model_path(name: str, home: Path | None = None) -> Path:
    root = (home or tandem_home()) / "models"
    if name in PACKAGED_MODELS:
        return build_packaged_model(name, root)
    if name not in BUILTIN_MODELS:
        raise ValueError(f"unknown built-in model '{name}'; choose one of {list(BUILTIN_MODEL_NAMES)}")
    return build_builtin_model(name, root)


def resolve_model_path(spec: ModelSpec, home: Path | None = None) -> str:
    if spec.builtin is not None:
        return str(builtin_model_path(spec.builtin, home))
    folder = Path(spec.path or "").expanduser()
    if not (folder / "config.json").exists():
        raise FileNotFoundError(
            f"model.path '{spec.path}' is not a Hugging Face model folder (no config.json there)"
        )
    return str(folder)


def context_length(folder: str | Path) -> int | None:
    """The longest sequence the model in `folder` takes, from its config.json, read as JSON (the API
    process has no transformers); a rope scaled by a factor stretches it, as vLLM counts it. None: the
    config does not say, or cannot be read."""
    path = Path(folder) / "config.json"
    try:
        if not path.is_file() or path.stat().st_size > MAX_CONFIG_BYTES:
            return None
        config = json.loads(path.read_bytes())
    except (OSError, ValueError, RecursionError):
        return None
    config = config if isinstance(config, dict) else {}
    config = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    length = next((v for k in _CONTEXT_KEYS if _positive_int(v := config.get(k))), None)
    scaling = config.get("rope_scaling")
    if length and isinstance(scaling, dict) and scaling.get("rope_type", scaling.get("type")) in _STRETCHING:
        factor = scaling.get("factor")
        if isinstance(factor, int | float) and 1 < factor and math.isfinite(factor):
            length = int(length * factor)
    return length


def _positive_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0
