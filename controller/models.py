"""Where a job's model comes from: a local Hugging Face folder, or a built-in model (engines/models/tiny_models.py,
engines/models/pretrained.py) built on first use under `$TANDEM_HOME/models/<name>` (default ~/.tandem).
"""

from __future__ import annotations

import os
from pathlib import Path

from engines.models.pretrained import PACKAGED_MODELS, build_packaged_model
from engines.models.tiny_models import BUILTIN_MODELS, build_builtin_model
from schema.job import ModelSpec

BUILTIN_MODEL_NAMES: tuple[str, ...] = tuple(sorted([*BUILTIN_MODELS, *PACKAGED_MODELS]))


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
