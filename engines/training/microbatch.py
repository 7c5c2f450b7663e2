"""Cutting one rank's batch into micro-batches: a fixed number of samples, or a token budget.

Under a budget, sequences go longest first into the lightest of k bins, k growing until every bin
fits. Every forward of a sharded model is a collective, so the ranks agree (`agree`: an all-reduce
MAX over the dp group) on the largest k any of them needs.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import NamedTuple

# Auto token budget: scale / hidden_size tokens. On CPU small, so activations stay in the caches; on
# CUDA it only bounds activation memory.
TOKEN_BUDGET_SCALE = {"cpu": 2048 * 512, "cuda": 32768 * 1024}


def auto_token_budget(hidden_size: int, device_type: str) -> int:
    """The default `max_tokens_per_micro_batch` when a config sets neither it nor a fixed size."""
    scale = TOKEN_BUDGET_SCALE.get(device_type, TOKEN_BUDGET_SCALE["cpu"])
    return max(1, scale // max(1, hidden_size))


class MicroBatchError(ValueError):
    """The micro-batch configuration cannot serve this batch."""


def fixed_micro_batches(num_samples: int, micro_batch_size: int | None) -> list[list[int]]:
    """Contiguous index slices of `micro_batch_size` samples (the whole batch when None)."""
    if num_samples <= 0:
        raise MicroBatchError("cannot cut an empty batch into micro-batches")
    size = micro_batch_size or num_samples
    return [list(range(start, min(start + size, num_samples))) for start in range(0, num_samples, size)]


def balanced_partition(lengths: Sequence[int], bins: int) -> list[list[int]]:
    """Longest-first greedy assignment of sample indices to `bins` bins of near-equal token sums;
    deterministic (indices sorted, bins ordered by their first index)."""
    if not 0 < bins <= len(lengths):
        raise MicroBatchError(f"cannot split {len(lengths)} samples into {bins} non-empty micro-batches")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    heap = [(0, b) for b in range(bins)]  # (load, bin id)
    members: list[list[int]] = [[] for _ in range(bins)]
    for i in order:
        load, b = heapq.heappop(heap)
        members[b].append(i)
        heapq.heappush(heap, (load + lengths[i], b))
    return sorted((sorted(m) for m in members), key=lambda m: m[0])


@dataclass
class PromptGroups:
    """Rows that share a prompt (`engines.kernels.shared_prompt.prompt_groups`) and each row's prompt length:
    packed, a micro-batch holds each group's prompt once."""

    rows: list[list[int]]
    prompt_lens: Sequence[int]  # per row of the batch

    @cached_property
    def group_of(self) -> dict[int, int]:
        return {row: g for g, members in enumerate(self.rows) for row in members}

    def packed_tokens(self, lengths: Sequence[int], micro_batch: Sequence[int]) -> int:
        seen: set[int] = set()
        total = 0
        for i in micro_batch:
            group = self.group_of.get(i, -1 - i)  # a row in no group shares nothing
            total += lengths[i] - (self.prompt_lens[i] if group in seen else 0)
            seen.add(group)
        return total

    def within(self, rows: list[int]) -> PromptGroups | None:
        """The groups restricted to `rows`, renumbered as positions in `rows`; None when none is left."""
        position = {row: j for j, row in enumerate(rows)}
        within = [[position[i] for i in g if i in position] for g in self.rows]
        kept = [g for g in within if g]
        return PromptGroups(kept, [self.prompt_lens[i] for i in rows]) if kept else None


def dynamic_micro_batches(
    lengths: Sequence[int],
    max_tokens: int,
    agree: Callable[[int], int] = lambda k: k,
    groups: PromptGroups | None = None,
) -> list[list[int]]:
    """Balanced micro-batches of at most `max_tokens` packed tokens, the same count on every rank;
    a prompt group that fits the budget stays in one micro-batch, so its prompt runs once."""
    longest = max(lengths)
    if longest > max_tokens:
        raise MicroBatchError(
            f"max_tokens_per_micro_batch={max_tokens} is smaller than the longest sequence ({longest} tokens): "
            "raise the budget to at least the prompt length plus the response length"
        )

    def cost(micro_batch: Sequence[int]) -> int:
        if groups is None:
            return sum(lengths[i] for i in micro_batch)
        return groups.packed_tokens(lengths, micro_batch)

    units = _units(len(lengths), max_tokens, groups, cost)
    loads = [cost(unit) for unit in units]
    bins = max(1, math.ceil(sum(loads) / max_tokens))
    while True:
        plan = unit_partition(loads, units, min(bins, len(units)))
        if max(cost(mb) for mb in plan) <= max_tokens:
            break
        bins += 1
    agreed = agree(len(plan))
    if agreed == len(plan):
        return plan
    _check_enough(len(lengths), agreed)
    return (
        unit_partition(loads, units, agreed) if agreed <= len(units) else balanced_partition(lengths, agreed)
    )


def _check_enough(samples: int, count: int) -> None:
    if samples < count:
        raise MicroBatchError(
            f"another data-parallel rank needs {count} micro-batches but this rank has only "
            f"{samples} samples; give every rank the same number of samples"
        )


def _units(
    rows: int,
    max_tokens: int,
    groups: PromptGroups | None,
    cost: Callable[[Sequence[int]], int],
) -> list[list[int]]:
    """What the planner places whole: each group that fits the budget, every other row alone."""
    if groups is None:
        return [[i] for i in range(rows)]
    units: list[list[int]] = []
    for group in groups.rows:
        if cost(group) <= max_tokens:
            units.append(list(group))
        else:
            units.extend([i] for i in group)
    return units


def unit_partition(loads: Sequence[int], units: list[list[int]], bins: int) -> list[list[int]]:
    """`balanced_partition` of whole units (lists of sample indices), expanded to sample indices."""
    plan = [sorted(i for u in members for i in units[u]) for members in balanced_partition(loads, bins)]
    return sorted(plan, key=lambda mb: mb[0])


class SplitPlan(NamedTuple):
    """Micro-batches of one call when some rows need no backward (see `split_by_backward`)."""

    backward: list[list[int]]  # micro-batches that run forward and backward
    forward: list[list[int]]  # micro-batches of rows whose gradient is known to be zero: forward only
    idle_forwards: int  # forwards this rank runs, outputs unused, to keep step with the other ranks


def split_by_backward(
    lengths: Sequence[int],
    needs_backward: Sequence[bool],
    plan: Callable[[list[int]], list[list[int]]],
    agree: Callable[[int], int] = lambda k: k,
) -> SplitPlan:
    """Plan the rows that need a backward and those that do not as separate micro-batches.

    `plan(rows)` cuts a subset locally; the ranks then agree on both counts. A rank short of backward
    rows moves forward-only ones over (their gradient is zero); one short of forward-only rows runs
    idle forwards.
    """
    backward = [i for i, b in enumerate(needs_backward) if b]
    forward = sorted((i for i, b in enumerate(needs_backward) if not b), key=lambda i: (lengths[i], i))
    agreed_backward = agree(len(plan(backward)) if backward else 0)
    while len(backward) < agreed_backward and forward:
        backward.append(forward.pop(0))  # the shortest first: the cheapest extra backward
    backward.sort()
    forward.sort()
    back_plan = _agreed_partition(backward, lengths, plan, agreed_backward)
    agreed_forward = agree(len(plan(forward)) if forward else 0)
    forward_plan = _agreed_partition(forward, lengths, plan, min(agreed_forward, len(forward)))
    return SplitPlan(back_plan, forward_plan, agreed_forward - len(forward_plan))


def _agreed_partition(
    rows: list[int], lengths: Sequence[int], plan: Callable[[list[int]], list[list[int]]], count: int
) -> list[list[int]]:
    """`rows` in `count` micro-batches: the local plan when it has that many, else balanced bins."""
    if count == 0:
        return []
    _check_enough(len(rows), count)
    local = plan(rows)
    if len(local) == count:
        return local
    return [[rows[j] for j in mb] for mb in balanced_partition([lengths[i] for i in rows], count)]


@dataclass
class MicroBatchPlanner:
    """One rank's micro-batch plan for an engine call; with neither `micro_batch_size` nor `max_tokens`
    the budget is `auto_token_budget`, never below the longest sequence."""

    micro_batch_size: int | None
    max_tokens: int | None
    hidden_size: int
    device_type: str
    agree: Callable[[int], int]

    def budget(self, lengths: Sequence[int]) -> int | None:
        """The token budget of dynamic batching; None for fixed-size micro-batches."""
        if self.max_tokens is None and self.micro_batch_size is None:
            return max(auto_token_budget(self.hidden_size, self.device_type), max(lengths))
        return self.max_tokens

    def plan(self, lengths: Sequence[int], groups: PromptGroups | None = None) -> list[list[int]]:
        """Micro-batches of all rows, the same count on every rank."""
        budget = self.budget(lengths)
        if budget is not None:
            return dynamic_micro_batches(lengths, budget, self.agree, groups)
        plan = fixed_micro_batches(len(lengths), self.micro_batch_size)
        if self.agree(len(plan)) != len(plan):
            raise MicroBatchError("every data-parallel rank must get the same number of samples per call")
        return plan

    def split(
        self,
        lengths: Sequence[int],
        needs_backward: Sequence[bool] | None,
        groups: PromptGroups | None = None,
    ) -> SplitPlan:
        """All rows as backward micro-batches (`needs_backward` None), or split by `split_by_backward`."""
        if needs_backward is None:
            return SplitPlan(self.plan(lengths, groups), [], 0)
        return split_by_backward(
            lengths, needs_backward, lambda rows: self.local_plan(rows, lengths, groups), self.agree
        )

    def local_plan(
        self, rows: list[int], lengths: Sequence[int], groups: PromptGroups | None
    ) -> list[list[int]]:
        """Micro-batches of a subset of the rows, before the ranks agree on a count."""
        sub = [lengths[i] for i in rows]
        budget = self.budget(sub)
        if budget is None:
            local = fixed_micro_batches(len(rows), self.micro_batch_size)
        else:
            local = dynamic_micro_batches(sub, budget, groups=groups.within(rows) if groups else None)
        return [[rows[j] for j in mb] for mb in local]
