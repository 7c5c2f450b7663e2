"""One printed form per kind of number, for the CLI and the job's log lines.

Scores, rewards and accuracies live on a 0-1 scale and are compared across steps and jobs, so they
print with three decimals, zeros included: 0.238, 1.000, 0.000. Every other metric (losses, learning
rates, norms, seconds, counts) prints with four significant digits: 0.2918, 0.0015, 9.341, 3.
"""

from __future__ import annotations

from typing import Any

SCORE_PARTS = frozenset({"accuracy", "score", "reward", "rewards"})
COUNT_PARTS = frozenset({"errors"})  # "reward/errors" is a count, not a score


def is_score(key: str) -> bool:
    parts = key.split("/")
    return bool(SCORE_PARTS.intersection(parts)) and not COUNT_PARTS.intersection(parts)


def format_metric(key: str, value: Any) -> str:
    """`value` of metric `key` as the CLI and the logs print it ("-" when missing)."""
    if value is None:
        return "-"
    if isinstance(value, bool) or not isinstance(value, int | float):
        return str(value)
    return f"{value:.3f}" if is_score(key) else f"{value:.4g}"


def format_metrics(values: dict[str, Any], sep: str = "=") -> str:
    """`key=value, ...` in the metric's own form."""
    return ", ".join(f"{key}{sep}{format_metric(key, value)}" for key, value in values.items())
