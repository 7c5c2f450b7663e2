"""One printed form per kind of number, for the CLI and the job's log lines: scores, rewards and
accuracies (0-1, compared across jobs) with three decimals (0.238, 1.000); everything else with four
significant digits (0.2918, 9.341, 3).
"""

from __future__ import annotations

from typing import Any

SCORE_PARTS = frozenset({"accuracy", "score", "reward", "rewards"})
COUNT_PARTS = frozenset({"errors"})  # "reward/errors" is a count, not a score


def is_score(key: str) -> bool:
    parts = key.split("/")
    return bool(SCORE_PARTS.intersection(parts)) and not COUNT_PARTS.intersection(parts)


def format_metric(key: str, value: Any) -> str:
    """ "-" when missing."""
    if value is None:
        return "-"
    if isinstance(value, bool) or not isinstance(value, int | float):
        return str(value)
    return f"{value:.3f}" if is_score(key) else f"{value:.4g}"


def format_metrics(values: dict[str, Any], sep: str = "=") -> str:
    return ", ".join(f"{key}{sep}{format_metric(key, value)}" for key, value in values.items())
