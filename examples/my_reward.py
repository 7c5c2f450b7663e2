"""A custom reward function for examples/custom_reward.yaml: partial credit on the arithmetic task.

A reward function takes (prompt, response, ground_truth, extra) and returns a float, or a dict with
a "score" and any other numbers to log (each shows up as the metric "reward/<name>/mean"). A sample
whose function raises scores 0.0 and is counted in "reward/errors"; the job goes on.
"""

from __future__ import annotations

import re
from typing import Any

_INTEGER = re.compile(r"-?\d+")


def score(prompt: str, response: str, ground_truth: Any, extra: dict | None = None) -> dict[str, float]:
    """1.0 for the right answer; otherwise up to 0.5 for how many of its digits are in place."""
    found = _INTEGER.search(response)
    truth = str(ground_truth).strip()
    if found is None:
        return {"score": 0.0, "exact": 0.0, "has_number": 0.0}
    answer = found.group()
    if answer == truth:
        return {"score": 1.0, "exact": 1.0, "has_number": 1.0}
    same = sum(a == b for a, b in zip(answer[::-1], truth[::-1], strict=False))
    return {"score": 0.5 * same / max(len(truth), len(answer)), "exact": 0.0, "has_number": 1.0}
