"""References to user code: "package.module:name" or "path/to/file.py:name" -> the object named.

Reward functions (controller/rewards.py) and environment classes (workers/environments/loader.py)
are both addressed this way; each handles its own "builtin:NAME" table and checks the object's
shape, and both resolve everything else through `resolve_reference`. It lives in workers/ because
environments are loaded by workers, which must not import the controller.

A file is executed afresh on every load, under one module name per absolute path (so two files both
called rewards.py do not collide): the API process is long-lived and users edit their files.
Importing runs arbitrary code, so the API never calls this itself: it checks references in a child
process (controller/user_code.py).
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import sys
from pathlib import Path
from typing import Any


def split_reference(ref: Any, what: str, forms: str, error: type[ValueError]) -> tuple[str, str]:
    """(source, name) of "source:name"; `error` names `what` and the accepted `forms` when malformed."""
    source, _, name = ref.rpartition(":") if isinstance(ref, str) else ("", "", "")
    if not source or not name:
        raise error(f"{what} {ref!r} is malformed: expected {forms}")
    return source, name


def is_path_source(source: str) -> bool:
    """Whether the part before ':' names a Python file rather than a module."""
    return source.endswith(".py") or "/" in source or "\\" in source


def is_path_reference(ref: str) -> bool:
    """Whether `ref` names a Python file ('path/file.py:name'), not a module or a built-in."""
    source = ref.rpartition(":")[0]
    return source != "builtin" and is_path_source(source)


def resolve_reference(ref: str, what: str, error: type[ValueError]) -> Any:
    """The object "source:name" names (a dotted name reaches nested attributes); raises `error`,
    a message naming `what` and `ref`, when the module does not import or has no such attribute."""
    source, _, name = ref.rpartition(":")
    module = (
        _load_file(ref, source, what, error) if is_path_source(source) else _import(ref, source, what, error)
    )
    target, owner = module, source
    for part in name.split("."):
        if not hasattr(target, part):
            raise error(f"{what} '{ref}' not found: '{owner}' has no attribute '{part}'")
        target, owner = getattr(target, part), f"{owner}:{part}" if owner == source else f"{owner}.{part}"
    return target


def describe_exception(exc: BaseException) -> str:
    """ImportError messages read well alone ("No module named 'x'"); others need their type."""
    return str(exc) if isinstance(exc, ImportError) and str(exc) else f"{type(exc).__name__}: {exc}"


def _import(ref: str, module_name: str, what: str, error: type[ValueError]) -> Any:
    try:
        return importlib.import_module(module_name)
    except Exception as exc:  # an import runs arbitrary code: any failure is the user's to see
        raise error(f"{what} '{ref}' could not be imported: {describe_exception(exc)}") from exc


def _load_file(ref: str, source: str, what: str, error: type[ValueError]) -> Any:
    path = Path(source).expanduser().resolve()
    if not path.is_file():
        raise error(f"{what} '{ref}' could not be imported: no such file {str(path)!r}")
    module_name = "tandem_user_" + hashlib.sha1(str(path).encode()).hexdigest()[:12]
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise error(f"{what} '{ref}' could not be imported: {path} is not a Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        sys.modules.pop(module_name, None)
        raise error(f"{what} '{ref}' could not be imported: {describe_exception(exc)}") from exc
    return module
