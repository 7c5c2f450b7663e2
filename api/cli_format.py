"""How the CLI prints: text from the service made safe for a terminal, tables with aligned columns,
clock times and durations."""

from __future__ import annotations

import re
import time
from typing import Any

# C0 and C1 controls, DEL, and the bidi marks that reorder what follows: a terminal acts on them (moves
# the cursor, sets the title or the clipboard, rewrites a line), and a tenant writes much of what we print.
UNSAFE = re.compile("[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]")


def printable(value: Any, lines: bool = False) -> str:
    """`value` as a terminal shows it literally: controls and bidi marks as escapes (\\x1b, \\u202e);
    `lines`: multi-line text (a model's answer) keeps its newlines."""
    return UNSAFE.sub(lambda m: m[0] if lines and m[0] == "\n" else _escape(m[0]), str(value))


def _escape(char: str) -> str:
    code = ord(char)
    return {"\n": "\\n", "\r": "\\r", "\t": "\\t"}.get(char) or (
        f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"
    )


def table(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> str:
    rows = [tuple(map(printable, r)) for r in rows]
    widths = [max(len(str(r[i])) for r in (header, *rows)) for i in range(len(header))]
    return "\n".join("  ".join(f"{str(c):<{w}}" for c, w in zip(r, widths, strict=True)).rstrip()
                     for r in (header, *rows))  # fmt: skip


MINUTES = "%Y-%m-%d %H:%M"


def clock(at: float | None, form: str = MINUTES + ":%S") -> str:
    return time.strftime(form, time.localtime(at)) if at else "-"


def duration(start: float | None, end: float | None) -> str:
    if not start:
        return "-"
    seconds = int((end or time.time()) - start)
    hours, rest = divmod(seconds, 3600)
    return f"{hours}h{rest // 60:02d}m" if hours else f"{rest // 60}m{rest % 60:02d}s"
