"""Rule rewards: functions `fn(prompt, response, ground_truth, extra) -> float | dict` addressed by a
reference string ("builtin:NAME", "module:function", "path/to/file.py:function"), scored in batches.

A dict result carries "score" plus at most MAX_METRICS extra numeric metrics (logged as
"reward/<name>/mean"). A sample whose function raises or returns anything but a number within
±MAX_ABS_REWARD is not scored (a 0.0 placeholder, its error in `row_errors`; the step leaves it out,
controller/step_math.py) and counts in "reward/errors"; the others of its batch are scored. User code and
SANDBOXED_BUILTINS run in long-lived sandboxes (workers/sandbox/); no torch or Ray at the top, because
scoring processes import this module.
"""

from __future__ import annotations

import logging
import math
import numbers
import re
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from controller.reasoning_gym_task import reasoning_gym_reward
from controller.tasks.arithmetic import arithmetic_partial_reward, arithmetic_reward
from controller.tasks.word_problems import word_problem_reward
from schema.openai_bodies import MAX_ABS_REWARD
from workers.references import check_function, describe_exception, load_reference, parse_reference
from workers.sandbox.channel import SandboxTimeout, UserCode
from workers.sandbox.limits import Limits

if TYPE_CHECKING:
    import torch

RewardFn = Callable[[str, str, Any, dict | None], float | dict[str, float]]
REWARD_PARAMS = ("prompt", "response", "ground_truth", "extra")
REFERENCE_FORMS = "'builtin:NAME', 'module:function' or 'path/to/file.py:function'"
MAX_METRICS = 32  # extra metrics of one result: each becomes a series of the job's metrics
RETRY_FAILURES = 3  # rows of a failed chunk whose own call fails too, before the rest are given up
log = logging.getLogger("tandem.job")


class RewardFunctionError(ValueError):
    """A reward reference that cannot be resolved into a usable function."""


_NUMBER = re.compile(r"[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)?(?:\.\d+|\d)(?:[eE][-+]?\d+)?")


def exact_match(prompt: str, response: str, ground_truth: Any, extra: dict | None = None) -> float:
    """1.0 when the stripped response equals the stripped ground truth."""
    return float(response.strip() == str(ground_truth).strip())


def numeric_match(prompt: str, response: str, ground_truth: Any, extra: dict | None = None) -> float:
    """1.0 when the last number is within max(abs_tol, rel_tol * |truth|) (`extra`, 1e-6 each) of the
    truth; a ground truth that is not a number is the data's error (it raises)."""
    truth = _to_number(ground_truth)
    numbers = _NUMBER.findall(response)
    if not numbers:
        return 0.0
    guess = _to_number(numbers[-1])
    extra = extra or {}
    tolerance = max(float(extra.get("abs_tol", 1e-6)), float(extra.get("rel_tol", 1e-6)) * abs(truth))
    return float(abs(guess - truth) <= tolerance)


def _to_number(value: Any) -> float:
    if isinstance(value, bool):
        raise ValueError(f"ground truth {value!r} is a bool, not a number")
    if isinstance(value, int | float):
        return float(value)
    return float(str(value).strip().replace(",", ""))


def math_verify(prompt: str, response: str, ground_truth: Any, extra: dict | None = None) -> float:
    """1.0 when math-verify judges the final answer equivalent to the ground truth. Its timeouts use
    signal.alarm, which raises off the main thread, so they are on only there."""
    from math_verify import parse, verify  # imported on first use: it pulls in sympy (slow)

    seconds = 5 if threading.current_thread() is threading.main_thread() else None
    truth = str(ground_truth).strip()
    gold = parse(truth, parsing_timeout=seconds)
    if not gold and "$" not in truth and "\\boxed" not in truth:
        gold = parse(f"${truth}$", parsing_timeout=seconds)  # a bare LaTeX answer such as \frac{1}{2}
    if not gold:
        raise ValueError(f"math-verify could not parse the ground truth {truth!r}")
    guess = parse(response, parsing_timeout=seconds)
    return float(bool(guess) and verify(gold, guess, timeout_seconds=seconds))


def format_boxed(prompt: str, response: str, ground_truth: Any, extra: dict | None = None) -> float:
    """1.0 when the response contains \\boxed{...} with balanced braces and something inside."""
    start = response.find("\\boxed{")
    while start != -1:
        depth, i = 1, start + len("\\boxed{")
        while i < len(response) and depth:
            depth += {"{": 1, "}": -1}.get(response[i], 0)
            i += 1
        if depth == 0 and response[start + len("\\boxed{") : i - 1].strip():
            return 1.0
        start = response.find("\\boxed{", start + 1)
    return 0.0


BUILTIN_REWARDS: dict[str, RewardFn] = {
    "exact_match": exact_match,
    "numeric_match": numeric_match,
    "math_verify": math_verify,
    "format_boxed": format_boxed,
    "arithmetic": arithmetic_reward,
    "arithmetic_partial": arithmetic_partial_reward,
    "word_problems": word_problem_reward,
    "reasoning_gym": reasoning_gym_reward,
}
# Built-ins whose scoring runs code on the completion (reasoning-gym's scorers eval answers).
SANDBOXED_BUILTINS = ("builtin:reasoning_gym",)
# Built-ins that compare a response with its row's ground truth (a row without one would be scored
# against the text "None": the data loader refuses it).
_TRUTH = ("exact_match", "numeric_match", "math_verify", "arithmetic", "arithmetic_partial", "word_problems")
GROUND_TRUTH_REWARDS = frozenset(f"builtin:{name}" for name in _TRUTH)


def load_reward_fn(ref: str) -> RewardFn:
    """Resolve `ref` into a validated reward function; raises RewardFunctionError saying why not."""
    fn = load_reference(ref, "reward function", REFERENCE_FORMS, RewardFunctionError, BUILTIN_REWARDS)
    return check_function(
        ref, fn, "reward function", RewardFunctionError, REWARD_PARAMS, trust_unreadable=True
    )


# (score, extra metrics, error message or None)
SampleResult = tuple[float, dict[str, float], str | None]


@dataclass
class RewardResult:
    scores: torch.Tensor  # [N] float32; a 0.0 placeholder where scoring failed (row_errors says where)
    metrics: dict[str, float]  # "reward/<name>/mean" per extra metric, "reward/errors"
    errors: int
    error_messages: list[str] = field(default_factory=list)  # the first few, "sample i: ..."
    row_errors: list[str | None] = field(default_factory=list)  # per sample: its error, or None


class RewardScorer:
    """Scores batches with one reward function: a built-in here; user code (and SANDBOXED_BUILTINS) in
    sandboxes, checked at once when the first starts. With num_workers > 0, batches over
    `parallel_threshold` split over that many processes (a built-in's unsandboxed: the service's own
    code). A chunk whose call fails as a whole (its process died, or overran `timeout_s` and was ended)
    is scored again a row per call, so that only the rows that fail are errors."""

    MAX_ERROR_MESSAGES = 5

    def __init__(
        self, ref: str, num_workers: int = 0, parallel_threshold: int = 64, timeout_s: float | None = 300.0
    ) -> None:
        self.ref, self.parallel_threshold, self.timeout_s = ref, parallel_threshold, timeout_s or 7 * 86400.0
        form = parse_reference(ref, "reward function", REFERENCE_FORMS, RewardFunctionError).form
        trusted = form == "builtin" and ref not in SANDBOXED_BUILTINS
        self.fn = load_reward_fn(ref) if trusted else None
        # The service's own code needs no sandbox, nor limits beyond each call's time.
        self.mode = "none" if trusted else None
        self.limits = Limits(None, None) if trusted else Limits.from_env().long_lived()
        boxes = 0 if trusted and num_workers == 0 else max(1, num_workers)
        self.boxes: list[UserCode | None] = [None] * boxes
        self._lock = threading.Lock()
        if boxes:
            self._box(0)

    def score(
        self,
        prompts: Sequence[str],
        responses: Sequence[str],
        ground_truths: Sequence[Any] | None = None,
        extras: Sequence[dict | None] | None = None,
    ) -> RewardResult:
        n = len(responses)
        rows = list(
            zip(
                list(prompts),
                list(responses),
                [None] * n if ground_truths is None else list(ground_truths),
                [None] * n if extras is None else list(extras),
                strict=True,  # a length mismatch is a bug upstream: fail, never truncate
            )
        )
        if self.fn is not None and (not self.boxes or n <= self.parallel_threshold):
            results = [score_sample(self.fn, *row) for row in rows]
        else:
            results = self._score_in_boxes(rows)
        import torch  # here, not at the top: sandboxed scoring processes never need it

        scores, log, errors, messages = _summary(results, self.MAX_ERROR_MESSAGES)
        row_errors = [error for _, _, error in results]
        return RewardResult(torch.tensor(scores, dtype=torch.float32), log, errors, messages, row_errors)

    def _box(self, index: int) -> UserCode:
        """The index-th sandbox, started again after its process ended."""
        with self._lock:
            box = self.boxes[index]
            if box is None or not box.alive:
                if box is not None:
                    log.warning(
                        "reward sandbox %d of %s ended (%s): starting another", index, self.ref, box.ended
                    )
                what, check = f"reward function '{self.ref}'", "controller.user_code:check_here"
                box = UserCode(self.ref, what, RewardFunctionError, check, ["reward"],
                               limits=self.limits, mode=self.mode)  # fmt: skip
                self.boxes[index] = box
            return box

    def _score_in_boxes(self, rows: list[tuple]) -> list[SampleResult]:
        count = len(self.boxes) if len(rows) > self.parallel_threshold else 1
        size = max(1, math.ceil(len(rows) / count))
        chunks = [rows[i : i + size] for i in range(0, len(rows), size)]
        if len(chunks) == 1:
            return self._score_chunk(0, chunks[0])
        with ThreadPoolExecutor(len(chunks), thread_name_prefix="tandem-reward") as pool:
            parts = pool.map(self._score_chunk, range(len(chunks)), chunks)
            return [result for part in parts for result in part]

    def _score_chunk(self, index: int, rows: list[tuple]) -> list[SampleResult]:
        try:
            return _checked(self._call(index, rows, self.timeout_s), len(rows))
        except Exception as err:  # the sandbox ended or overran, or a row is not plain data
            if len(rows) == 1:
                return [(0.0, {}, self._failure(index, err))]
        return self._score_one_by_one(index, rows)

    def _score_one_by_one(self, index: int, rows: list[tuple]) -> list[SampleResult]:
        """A chunk that failed as a whole, again a row per call (each within `timeout_s`, a new sandbox
        after each failure) so that the failure is the row's that caused it; after RETRY_FAILURES failed
        rows, or that many time limits in all, the rest are not scored."""
        deadline, failures, results = time.monotonic() + RETRY_FAILURES * self.timeout_s, 0, []
        for row in rows:
            left = min(self.timeout_s, deadline - time.monotonic())
            if failures >= RETRY_FAILURES or left <= 0:
                why = f"failed on {failures} samples" if failures >= RETRY_FAILURES else "ran out of time"
                results.append((0.0, {}, f"not scored: reward sandbox {index} {why} of this batch"))
                continue
            try:
                results += _checked(self._call(index, [row], left), 1)
            except Exception as err:
                failures += 1
                results.append((0.0, {}, self._failure(index, err)))
        return results

    def _call(self, index: int, rows: list[tuple], timeout_s: float) -> Any:
        box = self._box(index)
        return box.call("controller.rewards:score_in_sandbox", [box.placed, rows], timeout_s)

    def _failure(self, index: int, err: Exception) -> str:
        if isinstance(err, SandboxTimeout):
            return f"reward sandbox {index} {err.message}"
        return f"reward sandbox {index} failed: {err}"[:500]

    def close(self) -> None:
        with self._lock:
            boxes, self.boxes = self.boxes, [None] * len(self.boxes)
        for box in boxes:
            if box is not None:
                box.close()

    def __enter__(self) -> RewardScorer:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()


def _checked(out: Any, n: int) -> list[SampleResult]:
    """The sandbox's answer as results, trusting nothing: it is the user's process that wrote it."""
    if not isinstance(out, list) or len(out) != n:
        return [(0.0, {}, "the reward sandbox answered something other than one result per row")] * n
    results: list[SampleResult] = []
    for item in out:
        try:
            score, metrics, error = item
            results.append(
                (0.0, {}, str(error)[:500]) if error is not None else _result({**metrics, "score": score})
            )
        except (TypeError, ValueError, ArithmeticError):
            results.append((0.0, {}, "the reward sandbox answered a malformed result"))
    return results


_FUNCTIONS: dict[str, RewardFn] = {}


def score_in_sandbox(ref: str, rows: list[list[Any]]) -> list[SampleResult]:
    """The sandbox's side of RewardScorer (the function resolved once per process)."""
    if ref not in _FUNCTIONS:
        _FUNCTIONS[ref] = load_reward_fn(ref)
    return [score_sample(_FUNCTIONS[ref], *row) for row in rows]


def score_sample(
    fn: RewardFn, prompt: str, response: str, ground_truth: Any, extra: dict | None
) -> SampleResult:
    """One row's result; whatever the function returns or raises fails this row only."""
    try:
        return _result(fn(prompt, response, ground_truth, extra))
    except (Exception, SystemExit) as exc:  # sys.exit() in a reward function: this row's failure too
        try:
            return 0.0, {}, describe_exception(exc)[:500]
        except Exception:  # an exception whose message itself raises
            return 0.0, {}, f"{type(exc).__name__} (its message could not be read)"


def _result(out: Any) -> SampleResult:
    metrics: dict[str, float] = {}
    if isinstance(out, dict):
        if "score" not in out:
            return 0.0, {}, f"returned a dict without a 'score' key (keys: {sorted(map(str, out))[:10]})"
        if len(out) > MAX_METRICS + 1 or any(len(str(k)) > 100 for k in out):
            return 0.0, {}, f"returned {len(out) - 1} metrics; at most {MAX_METRICS}, named in 100 characters"
        metrics = {
            str(k): v for k, v in ((k, _as_float(v)) for k, v in out.items() if k != "score") if v is not None
        }
        out = out["score"]
    score = _as_float(out)
    if score is None or abs(score) > MAX_ABS_REWARD:  # float32 scores: a larger one ends up inf or NaN
        expected = f"expected a number within ±{MAX_ABS_REWARD:g} or a dict with a 'score' key"
        return 0.0, {}, f"returned {repr(out)[:200]}; {expected}"
    return score, metrics, None


def _as_float(value: Any) -> float | None:
    """A finite float, or None for anything else (strings, None, NaN, inf, arrays)."""
    if isinstance(value, numbers.Real):
        result = float(value)
    elif getattr(value, "ndim", None) == 0 and hasattr(value, "item"):  # numpy / torch scalars
        return _as_float(value.item())
    else:
        return None
    return result if math.isfinite(result) else None


def score_rows(ref: str, rows: list[dict[str, Any]], max_messages: int = 5) -> dict[str, Any]:
    """Plain rows ({prompt, response, ground_truth, extra}) scored as plain data: what
    `POST /v1/rewards/validate` runs in a sandbox."""
    fn = load_reward_fn(ref)
    results = [score_sample(fn, r.get("prompt", ""), r["response"], r.get("ground_truth"), r.get("extra"))
               for r in rows]  # fmt: skip
    scores, log, errors, messages = _summary(results, max_messages)
    return {"scores": scores, "metrics": log, "errors": errors, "error_messages": messages}


def _summary(
    results: list[SampleResult], max_messages: int
) -> tuple[list[float], dict[str, float], int, list[str]]:
    sums: dict[str, float] = {}
    counts: dict[str, int] = {}
    messages = []
    for i, (_, metrics, error) in enumerate(results):
        if error is not None and len(messages) < max_messages:
            messages.append(f"sample {i}: {error}")
        for key, value in metrics.items():
            if key in sums or len(sums) < MAX_METRICS:  # rows that each name their own: a bounded few
                sums[key], counts[key] = sums.get(key, 0.0) + value, counts.get(key, 0) + 1
    errors = sum(error is not None for _, _, error in results)
    log = {f"reward/{key}/mean": sums[key] / counts[key] for key in sorted(sums) if math.isfinite(sums[key])}
    log["reward/errors"] = float(errors)
    return [score for score, _, _ in results], log, errors, messages
