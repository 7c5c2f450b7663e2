"""JSON request bodies checked before validation, on every route, for values no field type should see:
a lone UTF-16 surrogate (SQLite would store it and every later read of the row would fail), an integer
past 64 bits, or a body nested too deeply or with a number too long to parse.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import Request, Response
from fastapi.routing import APIRoute

from api.errors import invalid, is_json_media

INT64 = 2**63


def _lone_surrogate(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def _dotted(path: tuple[Any, ...]) -> str:
    return ".".join(str(p) for p in path) or "body"


def find_unstorable(value: Any) -> tuple[str, str] | None:
    """(dotted field, why) of the first value in parsed JSON that cannot be stored, or None."""
    stack: list[tuple[tuple[Any, ...], Any]] = [((), value)]
    while stack:
        path, item = stack.pop()
        if isinstance(item, str):
            if _lone_surrogate(item):
                return _dotted(path), "contains a lone UTF-16 surrogate, which is not valid Unicode text"
        elif isinstance(item, int) and not isinstance(item, bool):
            if not -INT64 <= item < INT64:
                return _dotted(path), "is outside the 64-bit integer range (-2^63 .. 2^63-1)"
        elif isinstance(item, dict):
            for key, child in reversed(item.items()):
                if _lone_surrogate(key):
                    return _dotted(path), "has a key with a lone UTF-16 surrogate, which is not valid Unicode"
                stack.append(((*path, key), child))
        elif isinstance(item, list):
            stack.extend(((*path, i), child) for i, child in reversed(list(enumerate(item))))
    return None


async def check_json_body(request: Request) -> None:
    """Raise a 422 naming the field when the body holds a value that cannot be stored."""
    if request.method in ("GET", "HEAD", "DELETE", "OPTIONS") or not is_json_media(
        request.headers.get("content-type", "application/json")
    ):
        return
    if not await request.body():
        return
    try:
        parsed = await request.json()
    except json.JSONDecodeError:
        return  # FastAPI reports it as a 422 on `body` (api/errors.py)
    except (RecursionError, UnicodeDecodeError) as exc:
        raise invalid(
            "body", f"the request body is not usable JSON ({type(exc).__name__})", "invalid_json"
        ) from None
    except ValueError as exc:  # Python reads integers of at most 4300 digits (sys.int_info)
        raise invalid("body", f"the request body is not usable JSON ({exc})", "invalid_json") from None
    found = find_unstorable(parsed)
    if found is not None:
        raise invalid(*found)


class CheckedRoute(APIRoute):
    """An APIRoute whose JSON body passes `check_json_body` before FastAPI validates it."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def checked(request: Request) -> Response:
            await check_json_body(request)
            return await handler(request)

        return checked
