"""DAPO dynamic sampling (Yu et al. 2025): fill the step's batch with groups that carry a signal.

A group whose n samples scored the same (after the over-long penalty) has zero group-relative
advantage, so it is dropped and more prompts are drawn, one full loader batch a round (the loader's
position always counts the prompts drawn), until enough groups or `max_rounds`. Extra groups are
discarded; a short batch is topped up with dropped groups (groups_padded), keeping the step's size.
A group's uid gets the round as a suffix: one prompt can come up twice in a step across epochs.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from workers.batch import Batch

# (round index) -> one loader batch of prompts, generated and scored: the batch, scores, metrics.
Round = Callable[[int], tuple[Batch, torch.Tensor, dict[str, float]]]


def uniform_groups(scores: torch.Tensor, n: int) -> torch.Tensor:
    """[G] bool: the groups of `n` consecutive samples whose scores are all equal."""
    grouped = scores.reshape(-1, n)
    return grouped.max(dim=1).values == grouped.min(dim=1).values


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
    batches, scores, signal, round_metrics = [], [], [], []
    while sum(int(s.sum()) for s in signal) < groups_wanted and len(batches) < max_rounds:
        batch, round_scores, metrics = draw(len(batches))
        batches.append(_with_round_uids(batch, len(batches)))
        scores.append(round_scores)
        signal.append(~uniform_groups(round_scores, n))
        round_metrics.append(metrics)
    has_signal = torch.cat(signal)
    kept, dropped = torch.nonzero(has_signal).squeeze(1), torch.nonzero(~has_signal).squeeze(1)
    used = min(len(kept), groups_wanted)
    groups = torch.cat([kept[:used], dropped[: groups_wanted - used]])  # topped up with dropped groups
    rows = (groups.unsqueeze(1) * n + torch.arange(n)).flatten()
    keys = sorted(set().union(*round_metrics))
    metrics = {key: float(np.mean([m[key] for m in round_metrics if key in m])) for key in keys}
    metrics.update(
        {
            "dynamic_sampling/prompts_drawn": float(len(has_signal)),
            "dynamic_sampling/groups_dropped": float(len(dropped)),
            "dynamic_sampling/rounds": float(len(batches)),
            "dynamic_sampling/groups_kept": float(used),
            "dynamic_sampling/groups_padded": float(groups_wanted - used),
        }
    )
    return Batch.concat(batches)[rows.numpy()], torch.cat(scores)[rows], metrics
