"""Resolve an environment reference ("builtin:NAME", "module:Class", "path/file.py:Class") to a class.

The class must be constructible without arguments, with `reset(row)` and `step(assistant_text)`.
The API runs this check in a child process at submission (controller/user_code.py); workers again.
"""

from __future__ import annotations

import inspect
from typing import Any

from workers.environments.openenv_ref import is_openenv_app
from workers.references import lookup_builtin, parse_reference, resolve_reference

REFERENCE_FORMS = "'builtin:NAME', 'module:Class' or 'path/to/file.py:Class'"


class EnvironmentReferenceError(ValueError):
    """A reference that does not resolve to a usable environment class."""


def load_environment_class(ref: str) -> Any:
    """The class (or OpenEnv server app) `ref` names, validated; EnvironmentReferenceError says why not."""
    from workers.environments import BUILTIN_ENVIRONMENTS

    if parse_reference(ref, "environment", REFERENCE_FORMS, EnvironmentReferenceError).form == "builtin":
        return lookup_builtin(ref, BUILTIN_ENVIRONMENTS, "environment", EnvironmentReferenceError)
    target = resolve_reference(ref, "environment", EnvironmentReferenceError)
    if is_openenv_app(target):
        return target
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
