"""DAPO dynamic sampling (Yu et al. 2025): fill the step's batch with groups that carry a signal.

A group-relative advantage (GRPO, RLOO, ...) is zero for every sample of a group whose rollout.n
samples got the same score, so such a group teaches nothing; dynamic sampling drops it and
generates for more prompts until the batch holds the step's number of groups again.

Each round draws one full batch of prompts from the data loader (so the loader's position, saved
in checkpoints, always counts exactly the prompts drawn: a resumed job neither skips nor repeats
one) and generates and scores it. Rounds stop once enough groups carry a signal, or after
`max_rounds`. Groups beyond the batch are discarded (their prompts count as drawn); a batch still
short after the last round is topped up with dropped groups, counted in groups_padded, so that the
step keeps its size (the mini-batch and rank arithmetic depends on it).

"Same score" means the score the advantages see, after the over-long penalty (controller/
overlong.py): a group whose answers differ only in length still has a signal. (DAPO filters on the
task accuracy; with a 0/1 reward and no length penalty the two agree.)

A group is its n consecutive rows (prompts are repeated interleaved). Its uid gets the round as a
suffix: a prompt can come up twice in one step when the loader rolls over to a new epoch, and the
two groups must stay two groups.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from workers.batch import Batch

# One round: (round index) -> the scored batch of one loader batch of prompts, its scores and metrics.
Round = Callable[[int], tuple[Batch, torch.Tensor, dict[str, float]]]


def uniform_groups(scores: torch.Tensor, n: int) -> torch.Tensor:
    """[G] bool: the groups of `n` consecutive samples whose scores are all equal."""
    grouped = scores.reshape(-1, n)
    return grouped.max(dim=1).values == grouped.min(dim=1).values


@dataclass
class _Pool:
    """Groups collected over rounds, as row batches and their scores, in the order drawn."""

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
        """The first `groups` groups, as one batch and scores (empty lists when none)."""
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
    """Rounds of `draw` until `groups_wanted` groups have non-uniform scores (see the module doc).

    Returns the batch of exactly `groups_wanted` groups, its scores, and metrics: the per-round
    metrics of `draw` averaged over rounds (rounds are equal in size), plus dynamic_sampling/
    prompts_drawn, groups_dropped, rounds, groups_kept and groups_padded."""
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
