"""How the CLI prints: tables with aligned columns, clock times and durations."""

from __future__ import annotations

import time


def table(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> str:
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
