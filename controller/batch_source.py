"""Where a step's scored samples come from, chosen once per job by `make_source` with its publisher:
`GeneratedSource` (sync, generated in the step), `LaneSource` (async: lanes ahead of the trainer,
controller/async_loop.py) and `AgentSource` (rollout.source external, controller/external_source.py).
Async sources keep the buffer's one staleness filter (`rollout_buffer.too_stale`), reported by
`staleness_metrics`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from controller.dynamic_sampling import sample_signal_groups
from controller.rollout_buffer import too_stale
from controller.weight_publisher import WeightPublisher
from workers.batch import Batch

if TYPE_CHECKING:
    from controller.trainer import Trainer

Scored = tuple[Batch, torch.Tensor, dict[str, float]]


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
    """`draw(round)`'s samples, scored: one round, or dynamic sampling's (controller/dynamic_sampling.py)."""

    def scored_round(round_index: int) -> Scored:
        with trainer.timed("gen"):
            batch = draw(round_index)
        with trainer.timed("reward"):
            return trainer.job.scored(batch)

    ds, spec = trainer.spec.algorithm.dynamic_sampling, trainer.spec
    if not ds.enabled:
        return scored_round(0)
    return sample_signal_groups(scored_round, spec.trainer.prompts_per_step, spec.rollout.n, ds.max_rounds)


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
