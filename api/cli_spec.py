"""A JobSpec from a YAML/JSON file and command-line flags, validated here before it is sent.

`--set a.b.c=value` reaches any field (the value is read as JSON when it parses, else a string).
Local paths a spec names are made absolute where they exist: relative to the spec file for paths
written in it, to the working directory for flags.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from schema.job import JobSpec
from schema.section import deep_merge
from service.errors import first_error
from service.files import CODE_FIELDS, PATH_FIELDS, spec_field


class UsageError(Exception):
    """Bad input the CLI finds itself, a spec's or a flag's (exit code 2)."""


class SpecError(UsageError, ValueError):
    """A spec that does not validate; the message starts with the field at fault."""


def parse_value(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def parse_assignments(items: list[str]) -> dict[str, Any]:
    """["trainer.total_steps=5", "optim.lr=1e-4"] as nested {"trainer": {"total_steps": 5}, ...}."""
    nested: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise SpecError(f"--set: '{item}' must be 'key.path=value'")
        *parents, leaf = key.strip().split(".")
        node = nested
        for part in parents:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise SpecError(f"--set: '{key}' sets a field inside a value set earlier")
        node[leaf] = parse_value(value)
    return nested


def load_spec_file(path: str | Path) -> dict[str, Any]:
    file = Path(path)
    try:
        loaded = yaml.safe_load(file.read_text())  # JSON is YAML too
    except OSError as err:
        raise SpecError(f"spec file '{path}': {err.strerror}") from None
    except yaml.YAMLError as err:
        raise SpecError(f"spec file '{path}' is not valid YAML or JSON: {err}") from None
    if loaded is None:
        return {}
    if not isinstance(loaded, dict):
        raise SpecError(
            f"spec file '{path}' must hold a mapping of JobSpec fields, not {type(loaded).__name__}"
        )
    return absolutize_paths(loaded, file.resolve().parent)


def absolutize_paths(spec: dict[str, Any], base: Path, strict: bool = False) -> dict[str, Any]:
    """A copy whose relative local paths that exist under `base` are absolute. `strict`: a relative .py
    file not under `base` is a SpecError (the service takes absolute paths only)."""
    out = copy.deepcopy(spec)
    for fields in PATH_FIELDS:
        parent, value = spec_field(out, fields)
        if isinstance(value, str) and (base / value).expanduser().exists():
            parent[fields[-1]] = str((base / value).expanduser().resolve())
    for fields in CODE_FIELDS:
        parent, value = spec_field(out, fields)
        if not isinstance(value, str):
            continue
        source, sep, name = value.rpartition(":")
        if not (sep and source.endswith(".py")) or Path(source).expanduser().is_absolute():
            continue
        if (base / source).expanduser().is_file():
            parent[fields[-1]] = f"{(base / source).expanduser().resolve()}:{name}"
        elif strict:
            raise SpecError(f"{'.'.join(fields)}: no file '{source}' in {base} (a relative path given as a "
                            "flag is read from the current folder)")  # fmt: skip
    return out


def model_override(model: str) -> dict[str, Any]:
    """`--model`: a folder path (has a '/' or starts with '.' or '~') or a built-in model's name."""
    if "/" in model or model.startswith((".", "~")):
        return {"path": model, "builtin": None}
    return {"builtin": model, "path": None}


def build_spec(
    file: str | None = None,
    method: str | None = None,
    model: str | None = None,
    steps: int | None = None,
    sets: list[str] | None = None,
) -> tuple[dict[str, Any], JobSpec]:
    """The file, then the shorthands, then --set, merged: (what the user gave, validated as a JobSpec).
    What the user gave is sent, not the dump with defaults, so that a CLI and a service of slightly
    different versions agree on any spec both understand."""
    raw = load_spec_file(file) if file else {}
    flags: dict[str, Any] = {}
    if method:
        flags["method"] = method
    if model:
        flags["model"] = model_override(model)
    if steps is not None:
        flags["trainer"] = {"total_steps": steps}
    flags = deep_merge(flags, parse_assignments(sets or []))
    merged = deep_merge(raw, absolutize_paths(flags, Path.cwd(), strict=True))
    return merged, validate(merged)


def validate(raw: dict[str, Any]) -> JobSpec:
    try:
        return JobSpec.model_validate(raw)
    except ValidationError as err:
        raise SpecError(describe(err)) from None


def describe(err: ValidationError) -> str:
    """The first error as 'field.path: message', the way the API names a field."""
    more = len(err.errors()) - 1
    return first_error(err)[0] + (f" (and {more} more)" if more else "")
