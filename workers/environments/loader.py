"""Resolve an environment reference ("builtin:NAME", "module:Class", "path/file.py:Class") to a class.

`load_environment_class` imports and checks the class: it must be constructible without arguments
and have `reset(row)` and `step(assistant_text)` callable with one positional argument each. The
API runs this check in a separate process at submission (`python -m workers.environments.loader
REF` prints the verdict as JSON), so user code never runs inside the API process; workers call it
again to build their environments.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import json
import sys
from pathlib import Path
from typing import Any


class EnvironmentReferenceError(ValueError):
    """A reference that does not resolve to a usable environment class."""


def load_environment_class(ref: str) -> type:
    """The class `ref` names, validated; raises EnvironmentReferenceError saying why not."""
    from workers.environments import BUILTIN_ENVIRONMENTS

    source, _, name = ref.rpartition(":") if isinstance(ref, str) else ("", "", "")
    if not source or not name:
        raise EnvironmentReferenceError(
            f"environment {ref!r} is malformed: expected 'builtin:NAME', 'module:Class' or "
            "'path/to/file.py:Class'"
        )
    if source == "builtin":
        if name not in BUILTIN_ENVIRONMENTS:
            choices = ", ".join(f"'builtin:{n}'" for n in sorted(BUILTIN_ENVIRONMENTS))
            raise EnvironmentReferenceError(f"environment {ref!r} is not a built-in; choose one of {choices}")
        return BUILTIN_ENVIRONMENTS[name]
    module = _load_file(ref, source) if source.endswith(".py") or "/" in source else _import(ref, source)
    target: Any = module
    for part in name.split("."):
        if not hasattr(target, part):
            raise EnvironmentReferenceError(f"environment '{ref}' not found: no attribute '{part}'")
        target = getattr(target, part)
    check_environment_class(ref, target)
    return target


def check_environment_class(ref: str, cls: Any) -> None:
    if not inspect.isclass(cls):
        raise EnvironmentReferenceError(f"environment '{ref}' is not a class ({type(cls).__name__})")
    try:
        inspect.signature(cls).bind()
    except TypeError:
        raise EnvironmentReferenceError(
            f"environment '{ref}' must be constructible without arguments: {cls.__name__}"
            f"{inspect.signature(cls)}"
        ) from None
    except ValueError:  # no signature to inspect (a builtin type): let construction decide
        pass
    for method in ("reset", "step"):
        fn = getattr(cls, method, None)
        if not callable(fn):
            raise EnvironmentReferenceError(f"environment '{ref}' has no method {method}()")
        try:
            inspect.signature(fn).bind(None, None)  # (self, argument)
        except TypeError:
            raise EnvironmentReferenceError(
                f"environment '{ref}': {method}{inspect.signature(fn)} must accept one argument "
                f"after self ({'row' if method == 'reset' else 'assistant_text'})"
            ) from None


def _import(ref: str, module_name: str) -> Any:
    try:
        return importlib.import_module(module_name)
    except Exception as exc:
        raise EnvironmentReferenceError(f"environment '{ref}' could not be imported: {exc}") from None


def _load_file(ref: str, source: str) -> Any:
    path = Path(source).expanduser().resolve()
    if not path.is_file():
        raise EnvironmentReferenceError(
            f"environment '{ref}' could not be imported: no such file {str(path)!r}"
        )
    module_name = "tandem_env_" + hashlib.sha1(str(path).encode()).hexdigest()[:12]
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise EnvironmentReferenceError(f"environment '{ref}' could not be imported: {path} is not Python")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        sys.modules.pop(module_name, None)
        raise EnvironmentReferenceError(
            f"environment '{ref}' could not be imported: {type(exc).__name__}: {exc}"
        ) from None
    return module


def main(argv: list[str]) -> int:
    """`python -m workers.environments.loader REF`: prints {"ok": true} or {"ok": false, "error": ...}."""
    try:
        load_environment_class(argv[0])
    except EnvironmentReferenceError as err:
        print(json.dumps({"ok": False, "error": str(err)}))
        return 0
    print(json.dumps({"ok": True}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
