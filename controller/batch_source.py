"""Where a step's scored samples come from, chosen once per job by `make_source` with its publisher:
`GeneratedSource` (sync, generated in the step), `LaneSource` (async: lanes ahead of the trainer,
controller/async_loop.py) and `AgentSource` (rollout.source external, controller/external_source.py).
Async sources keep the buffer's one staleness filter (`rollout_buffer.too_stale`), reported by
`staleness_metrics`.

DAPO dynamic sampling (Yu et al. 2025, `sample_signal_groups`): a group whose n samples scored the same
(after the over-long penalty) has zero group-relative advantage, so it is dropped and more prompts are
drawn, one full loader batch a round (the loader's position always counts the prompts drawn), until
enough groups or `max_rounds`. Only the rows that scored count: a group with fewer than two (its
reward function failed on the others) has no signal either. Extra groups are discarded; a short batch is topped up with dropped
groups (groups_padded), keeping the step's size. A group's uid gets the round as a suffix: one prompt
can come up twice in a step across epochs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from controller.rollout_buffer import too_stale
from controller.weight_publisher import WeightPublisher
from engines.training.base import SCORED
from workers.batch import Batch

if TYPE_CHECKING:
    from controller.trainer import Trainer

Scored = tuple[Batch, torch.Tensor, dict[str, float]]
Round = Callable[[int], Scored]  # (round index) -> one loader batch of prompts, generated and scored


class BatchSource:
    """One step's scored samples for the trainer; what a source does not need is a no-op here."""

    def start(self) -> None:
        """This attempt's workers are up, the checkpoint (if any) loaded."""

    def next_batch(self) -> Scored:
        raise NotImplementedError

    def stats(self) -> dict[str, float]:
        """Counters recorded after every step's sync."""
        return {}

    def stop(self) -> None:
        """The attempt's workers are about to go."""

    def close(self) -> None:
        """The run is over, whatever its outcome: what the source keeps across attempts goes."""

    def state_dict(self, loader: dict[str, Any]) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """After the trainer loaded its own state."""


def make_source(trainer: Trainer) -> tuple[BatchSource, WeightPublisher]:
    if trainer.spec.rollout.source == "external":
        from controller.external_source import AgentSource

        source = AgentSource(trainer)
        return source, WeightPublisher(trainer, sent=source.sent)
    if trainer.spec.trainer.mode == "async":
        from controller.async_loop import LaneSource

        lanes = LaneSource(trainer)
        return lanes, lanes.publisher
    return GeneratedSource(trainer), WeightPublisher(trainer)


def in_rounds(trainer: Trainer, draw: Callable[[int], Batch]) -> Scored:
    """`draw(round)`'s samples, scored: one round, or dynamic sampling's."""

    def scored_round(round_index: int) -> Scored:
        with trainer.timed("gen"):
            batch = draw(round_index)
        with trainer.timed("reward"):
            return trainer.job.scored(batch)

    ds, spec = trainer.spec.algorithm.dynamic_sampling, trainer.spec
    if not ds.enabled:
        return scored_round(0)
    return sample_signal_groups(scored_round, spec.trainer.prompts_per_step, spec.rollout.n, ds.max_rounds)


def uniform_groups(scores: torch.Tensor, n: int, scored: torch.Tensor | None = None) -> torch.Tensor:
    """[G] bool: the groups of `n` consecutive samples whose scored rows (all, for None) are fewer
    than two or all equal."""
    grouped = scores.reshape(-1, n)
    kept = torch.ones_like(grouped, dtype=torch.bool) if scored is None else scored.reshape(-1, n).bool()
    high = grouped.masked_fill(~kept, -torch.inf).max(dim=1).values
    low = grouped.masked_fill(~kept, torch.inf).min(dim=1).values
    return (kept.sum(dim=1) < 2) | (high == low)


def _with_round_uids(batch: Batch, round_index: int) -> Batch:
    batch.non_tensors["uid"] = np.array(
        [f"{uid}/{round_index}" for uid in batch.non_tensors["uid"]], dtype=object
    )
    return batch


def sample_signal_groups(draw: Round, groups_wanted: int, n: int, max_rounds: int) -> Scored:
    """Rounds of `draw` until `groups_wanted` groups have non-uniform scores: exactly that many groups,
    their scores, and `draw`'s metrics averaged over rounds with the dynamic_sampling/ counts."""
    batches, scores, signal, round_metrics = [], [], [], []
    while sum(int(s.sum()) for s in signal) < groups_wanted and len(batches) < max_rounds:
        batch, round_scores, metrics = draw(len(batches))
        batches.append(_with_round_uids(batch, len(batches)))
        scores.append(round_scores)
        signal.append(~uniform_groups(round_scores, n, batch.tensors.get(SCORED, None)))
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


class GeneratedSource(BatchSource):
    """Sync: the rollout role generates for the loader's next prompts inside the step."""

    def __init__(self, trainer: Trainer) -> None:
        self.trainer = trainer

    def next_batch(self) -> Scored:
        t = self.trainer
        return in_rounds(t, lambda round_index: t.generate(t.job.next_prompts(t.step_index, round_index)))


def buffer_metrics(fill: float, dropped: int, dropped_total: int, waited: float) -> dict[str, float]:
    return {
        "async/buffer_fill": fill,
        "async/dropped_stale": float(dropped),
        "async/dropped_stale_total": float(dropped_total),
        "async/trainer_wait_s": waited,
    }


def staleness_metrics(metrics: dict[str, float], batch: Batch, version: int, k: int) -> dict[str, float]:
    """`metrics` with the samples' staleness (trainer version minus their oldest token's): mean, max,
    the histogram 0..k, and the samples sampled by more than one version."""
    staleness = version - batch.tensors["policy_version"]
    if too_stale(version, int(batch.tensors["policy_version"].min()), k):  # the buffer dropped these
        raise RuntimeError(f"a sample of staleness {int(staleness.max())} reached the update")
    metrics["async/staleness_mean"] = float(staleness.float().mean())
    metrics["async/staleness_max"] = float(staleness.max())
    if "token_versions" in batch.tensors.keys():  # partial rollouts: rows sampled by several versions
        tv = batch.tensors["token_versions"]
        newest = tv.max(-1).values
        oldest = tv.masked_fill(tv < 0, torch.iinfo(tv.dtype).max).min(-1).values
        metrics["async/multi_version_samples"] = float(((newest > oldest) & (newest >= 0)).sum())
    for age in range(k + 1):
        metrics[f"async/staleness_hist/{age}"] = float((staleness == age).sum())
    return metrics
