"""References to code: "builtin:NAME", "package.module:name" or "path/to/file.py:name".

`parse_reference` decides the form once for every caller; `resolve_reference` imports it (a file
under one module name per path). Importing runs user code: only sandboxed processes resolve users'.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

BUILTIN_PREFIX = "builtin:"
OPENENV_PREFIX = "openenv:"


@dataclass(frozen=True)
class Reference:
    """A parsed reference: `form` is "builtin" (`name` is the table key), "module" or "file"."""

    form: str
    source: str
    name: str


def parse_reference(ref: Any, what: str, forms: str, error: type[ValueError]) -> Reference:
    """The form, source and name of `ref`; `error` names `what` and the accepted `forms` when malformed."""
    if not isinstance(ref, str):
        raise error(f"{what} {ref!r} is malformed: expected {forms}")
    if ref.startswith(BUILTIN_PREFIX):
        return Reference("builtin", "", ref[len(BUILTIN_PREFIX) :])
    source, _, name = ref.rpartition(":")
    if not source or not _dotted(name):
        raise error(f"{what} {ref!r} is malformed: expected {forms}")
    if is_path_source(source):
        return Reference("file", source, name)
    if not _dotted(source):
        raise error(f"{what} {ref!r} is malformed: '{source}' is neither a module name nor a .py file")
    return Reference("module", source, name)


def _dotted(name: str) -> bool:
    return all(part.isidentifier() for part in name.split("."))


def lookup_builtin(ref: str, table: dict[str, Any], what: str, error: type[ValueError]) -> Any:
    """The entry of `table` that "builtin:NAME" names exactly; `error` lists the choices otherwise."""
    name = ref[len(BUILTIN_PREFIX) :] if ref.startswith(BUILTIN_PREFIX) else None
    if not table:
        raise error(f"{what} {ref[:200]!r}: there is no built-in {what}; name a module or a .py file")
    if name not in table:
        choices = ", ".join(f"'{BUILTIN_PREFIX}{n}'" for n in sorted(table))
        raise error(f"{what} {ref[:200]!r} is not a built-in; choose one of {choices}")
    return table[name]


def load_reference(ref: Any, what: str, forms: str, error: type[ValueError], builtins: dict[str, Any]) -> Any:
    """The entry of `builtins` that "builtin:NAME" names, or the object a module or file reference names."""
    if parse_reference(ref, what, forms, error).form == "builtin":
        return lookup_builtin(ref, builtins, what, error)
    return resolve_reference(ref, what, error)


def is_path_source(source: str) -> bool:
    """Whether the part before ':' names a Python file rather than a module."""
    return source.endswith(".py") or "/" in source or "\\" in source


def is_path_reference(ref: str) -> bool:
    """Whether `ref` names a Python file ('path/file.py:name'); never a 'builtin:' or 'openenv:' one."""
    if not isinstance(ref, str) or ref.startswith((BUILTIN_PREFIX, OPENENV_PREFIX)):
        return False
    return is_path_source(ref.rpartition(":")[0])


def resolve_reference(ref: str, what: str, error: type[ValueError]) -> Any:
    """The object a module or file reference names (dotted names reach nested attributes); `error`
    names `what` and `ref` when it does not import or has no such attribute. 'builtin:' is refused."""
    if ref.startswith(BUILTIN_PREFIX):
        raise error(f"{what} {ref[:200]!r} is a built-in name, not a module or file to import")
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


def check_function(
    ref: str, fn: Any, what: str, error: type[ValueError], params: tuple[str, ...], trust_unreadable: bool
) -> Any:
    """`fn` when it is a function that takes `params`, else `error` saying why; a signature that cannot
    be read (a C function) passes when `trust_unreadable` (its failures then count per call)."""
    expected = f"({', '.join(params)})"
    if inspect.isclass(fn):
        raise error(f"{what} '{ref}' is a class, not a function")
    if not callable(fn):
        raise error(f"{what} '{ref}' is not callable (type {type(fn).__name__})")
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        if trust_unreadable:
            return fn
        raise error(f"{what} '{ref}' has no readable signature; expected {expected}") from None
    try:
        signature.bind(*params)
    except TypeError:
        raise error(f"{what} '{ref}' has signature {signature}; expected {expected}") from None
    return fn


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
