"""A reward function scored in long-lived processes for a job's controller: checked at once when the
first starts, then one call per batch (large batches split over `workers` processes). A call past
`timeout_s` ends its process and its rows score 0.0 as errors. A user's function runs in sandboxes
(workers/sandbox/); a `trusted` built-in in the same processes without one.
"""

from __future__ import annotations

import math
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from workers.sandbox.channel import SandboxTimeout, UserCode
from workers.sandbox.limits import Limits

SampleResult = tuple[float, dict[str, float], str | None]


class SandboxedRewards:
    def __init__(self, ref: str, workers: int = 1, timeout_s: float | None = 300.0, parallel_threshold: int = 64,
                 trusted: bool = False) -> None:  # fmt: skip
        self.ref, self.timeout_s = ref, timeout_s or 7 * 86400.0
        self.parallel_threshold = parallel_threshold
        # The service's own code needs no sandbox, nor limits beyond each call's time.
        self.mode = "none" if trusted else None
        self.limits = Limits(None, None) if trusted else Limits.from_env().long_lived()
        self._boxes: list[UserCode | None] = [None] * max(1, workers)
        self._lock = threading.Lock()
        self._box(0)

    def _box(self, index: int) -> UserCode:
        """The index-th sandbox, started again after its process ended."""
        from controller.rewards import RewardFunctionError

        with self._lock:
            box = self._boxes[index]
            if box is None or not box.alive:
                what, check = f"reward function '{self.ref}'", "controller.user_code:check_here"
                box = UserCode(self.ref, what, RewardFunctionError, check, ["reward"],
                               limits=self.limits, mode=self.mode)  # fmt: skip
                self._boxes[index] = box
            return box

    def score(self, rows: list[tuple]) -> list[SampleResult]:
        count = len(self._boxes) if len(rows) > self.parallel_threshold else 1
        size = max(1, math.ceil(len(rows) / count))
        chunks = [rows[i : i + size] for i in range(0, len(rows), size)]
        if len(chunks) == 1:
            return self._score_chunk(0, chunks[0])
        with ThreadPoolExecutor(len(chunks), thread_name_prefix="tandem-reward") as pool:
            parts = pool.map(self._score_chunk, range(len(chunks)), chunks)
            return [result for part in parts for result in part]

    def _score_chunk(self, index: int, rows: list[tuple]) -> list[SampleResult]:
        try:
            box = self._box(index)
            out = box.call("controller.reward_sandbox:score_in_sandbox", [box.placed, rows], self.timeout_s)
        except SandboxTimeout:
            return [(0.0, {}, f"timed out after {self.timeout_s:g}s in the reward sandbox")] * len(rows)
        except Exception as err:  # the sandbox ended, or a row is not plain data: these rows only
            return [(0.0, {}, f"the reward sandbox failed: {err}"[:500])] * len(rows)
        return _checked(out, len(rows))

    def close(self) -> None:
        with self._lock:
            boxes, self._boxes = self._boxes, [None] * len(self._boxes)
        for box in boxes:
            if box is not None:
                box.close()


def _checked(out: Any, n: int) -> list[SampleResult]:
    """The sandbox's answer as results, trusting nothing: it is the user's process that wrote it."""
    if not isinstance(out, list) or len(out) != n:
        return [(0.0, {}, "the reward sandbox answered something other than one result per row")] * n
    results: list[SampleResult] = []
    for item in out:
        try:
            score, metrics, error = item
            score = float(score)
            metrics = {str(k): float(v) for k, v in dict(metrics).items() if math.isfinite(float(v))}
            results.append(
                (score if math.isfinite(score) else 0.0, metrics, None if error is None else str(error)[:500])
            )
        except (TypeError, ValueError):
            results.append((0.0, {}, "the reward sandbox answered a malformed result"))
    return results


_FUNCTIONS: dict[str, Any] = {}


def score_in_sandbox(ref: str, rows: list[list[Any]]) -> list[SampleResult]:
    """The sandbox's side (the function resolved once per process)."""
    from controller.rewards import load_reward_fn, score_sample

    if ref not in _FUNCTIONS:
        _FUNCTIONS[ref] = load_reward_fn(ref)
    return [score_sample(_FUNCTIONS[ref], *row) for row in rows]
