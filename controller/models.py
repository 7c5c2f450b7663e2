"""Where a job's model comes from: a local Hugging Face folder, or a built-in tiny model built on demand.

Built-in models live under `$TANDEM_HOME/models/<name>` (TANDEM_HOME defaults to ~/.tandem); they
are built the first time a job or `tandem models build NAME` asks for them, and reused after.
"""

from __future__ import annotations

import os
from pathlib import Path

from controller.spec import ModelSpec
from engines.tiny_models import BUILTIN_MODELS, build_builtin_model


def tandem_home() -> Path:
    return Path(os.environ.get("TANDEM_HOME") or Path.home() / ".tandem").expanduser()


def builtin_model_path(name: str, home: Path | None = None) -> Path:
    """Build (once) and return the folder of the named built-in model."""
    if name not in BUILTIN_MODELS:
        raise ValueError(f"unknown built-in model '{name}'; choose one of {sorted(BUILTIN_MODELS)}")
    return build_builtin_model(name, (home or tandem_home()) / "models")


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
