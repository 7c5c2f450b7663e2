"""DAPO dynamic sampling (Yu et al. 2025): fill the step's batch with groups that carry a signal.

A group whose n samples scored the same (after the over-long penalty) has zero group-relative
advantage, so it is dropped and more prompts are drawn, one full loader batch a round (the loader's
position always counts the prompts drawn), until enough groups or `max_rounds`. Extra groups are
discarded; a short batch is topped up with dropped groups (groups_padded), keeping the step's size.
A group's uid gets the round as a suffix: one prompt can come up twice in a step across epochs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from workers.batch import Batch

# (round index) -> one loader batch of prompts, generated and scored: the batch, scores, metrics.
Round = Callable[[int], tuple[Batch, torch.Tensor, dict[str, float]]]


def uniform_groups(scores: torch.Tensor, n: int) -> torch.Tensor:
    """[G] bool: the groups of `n` consecutive samples whose scores are all equal."""
    grouped = scores.reshape(-1, n)
    return grouped.max(dim=1).values == grouped.min(dim=1).values


@dataclass
class _Pool:
    """Groups collected over rounds, in the order drawn."""

    batches: list[Batch] = field(default_factory=list)
    scores: list[torch.Tensor] = field(default_factory=list)
    groups: int = 0

    def add(self, batch: Batch, scores: torch.Tensor, groups: torch.Tensor, n: int) -> None:
        if groups.any():
            rows = torch.nonzero(groups.repeat_interleave(n)).squeeze(1).numpy()
            self.batches.append(batch[rows])
            self.scores.append(scores[torch.as_tensor(rows)])
            self.groups += int(groups.sum())

    def take(self, groups: int, n: int) -> tuple[list[Batch], list[torch.Tensor]]:
        if groups == 0 or not self.batches:
            return [], []
        batch, scores = Batch.concat(self.batches), torch.cat(self.scores)
        return [batch[: groups * n]], [scores[: groups * n]]


def _with_round_uids(batch: Batch, round_index: int) -> Batch:
    batch.non_tensors["uid"] = np.array(
        [f"{uid}/{round_index}" for uid in batch.non_tensors["uid"]], dtype=object
    )
    return batch


def sample_signal_groups(
    draw: Round, groups_wanted: int, n: int, max_rounds: int
) -> tuple[Batch, torch.Tensor, dict[str, float]]:
    """Rounds of `draw` until `groups_wanted` groups have non-uniform scores: exactly that many groups,
    their scores, and `draw`'s metrics averaged over rounds with the dynamic_sampling/ counts."""
    kept, dropped = _Pool(), _Pool()
    round_metrics: list[dict[str, float]] = []
    prompts = rounds = 0
    while kept.groups < groups_wanted and rounds < max_rounds:
        batch, scores, metrics = draw(rounds)
        batch = _with_round_uids(batch, rounds)
        uniform = uniform_groups(scores, n)
        kept.add(batch, scores, ~uniform, n)
        dropped.add(batch, scores, uniform, n)
        round_metrics.append(metrics)
        prompts += len(uniform)
        rounds += 1
    used = min(kept.groups, groups_wanted)
    padded = groups_wanted - used
    batches, scores = kept.take(used, n)
    pad_batches, pad_scores = dropped.take(padded, n)
    keys = sorted(set().union(*round_metrics))
    metrics = {key: float(np.mean([m[key] for m in round_metrics if key in m])) for key in keys}
    metrics.update(
        {
            "dynamic_sampling/prompts_drawn": float(prompts),
            "dynamic_sampling/groups_dropped": float(dropped.groups),
            "dynamic_sampling/rounds": float(rounds),
            "dynamic_sampling/groups_kept": float(used),
            "dynamic_sampling/groups_padded": float(padded),
        }
    )
    return Batch.concat(batches + pad_batches), torch.cat(scores + pad_scores), metrics
