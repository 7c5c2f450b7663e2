"""A custom reward function for examples/custom_reward.yaml: credit for getting close on the arithmetic task.

A reward function takes (prompt, response, ground_truth, extra) and returns a float, or a dict with
a "score" and any other numbers to log (each shows up as the metric "reward/<name>/mean"). A sample
whose function raises scores 0.0 and is counted in "reward/errors"; the job goes on.
"""

from __future__ import annotations

import re
from typing import Any

_INTEGER = re.compile(r"-?\d+")


def score(prompt: str, response: str, ground_truth: Any, extra: dict | None = None) -> dict[str, float]:
    """1.0 for the right answer; otherwise up to 0.5 the closer the first number is to it."""
    found = _INTEGER.search(response)
    if found is None:
        return {"score": 0.0, "exact": 0.0, "has_number": 0.0}
    answer, truth = int(found.group()), int(str(ground_truth).strip())
    if answer == truth:
        return {"score": 1.0, "exact": 1.0, "has_number": 1.0}
    closeness = max(0.0, 1.0 - abs(answer - truth) / max(abs(truth), 1))
    return {"score": 0.5 * closeness, "exact": 0.0, "has_number": 1.0}
