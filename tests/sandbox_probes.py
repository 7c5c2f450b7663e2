"""Run a snippet of test code inside a sandbox (tests/test_sandbox.py): the snippet sets `result`."""

from __future__ import annotations

from typing import Any


def run(code: str) -> Any:
    scope: dict[str, Any] = {}
    exec(compile(code, "<probe>", "exec"), scope)
    return scope.get("result")
