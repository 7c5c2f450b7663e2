"""Where a step's scored samples come from, chosen once per job by `make_source` with its publisher:
`GeneratedSource` (sync, generated in the step), `LaneSource` (async: lanes ahead of the trainer, controller/async_loop.py) and
`AgentSource` (rollout.source external). Async sources keep the buffer's one staleness filter
(`rollout_buffer.too_stale`), reported by `staleness_metrics`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from controller.dynamic_sampling import sample_signal_groups
from controller.rollout_buffer import too_stale
from controller.weight_publisher import WeightPublisher
from schema.async_rl import staleness_bound
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


class AgentSource(BatchSource):
    """A step's rewarded trajectories from the job's endpoint (controller/external_source.py, kept
    across restarts): sync, the first whole groups; async, the groups young enough."""

    def __init__(self, trainer: Trainer) -> None:
        self.trainer = trainer
        self.endpoint: Any = None
        self.dropped_total = 0
        self.max_staleness = staleness_bound(trainer.spec)

    def start(self) -> None:
        from controller.external_source import ExternalSource

        t = self.trainer
        if self.endpoint is None:
            self.endpoint = ExternalSource(t.name, t.spec, t.job.model_path, t.step_index)
        self.endpoint.attach(t.job.groups, t.step_index)
        t.sink.event("endpoint", "the OpenAI-compatible endpoint serves this job's rollout workers")

    def close(self) -> None:
        """rollout.external.agent's pool: its thread would outlive the run in a long-lived process."""
        if self.endpoint is not None and self.endpoint.agents is not None:
            self.endpoint.agents.stop()

    def next_batch(self) -> Scored:
        if self.trainer.spec.trainer.mode == "async":
            return self._young_groups()
        return in_rounds(self.trainer, lambda _: self._trajectories())

    def _trajectories(self) -> Batch:
        t = self.trainer
        batch = self.endpoint.next_batch(lambda: t.control.stop_reason is not None, self._pad())
        if batch is None:
            t.stop_while_waiting()
        return batch

    def _young_groups(self) -> Scored:
        t = self.trainer
        version, start = t.step_index - 1, time.perf_counter()
        with t.timed("wait_rollout"):
            got = self.endpoint.next_async(version, lambda: t.control.stop_reason is not None, self._pad())
        if got is None:
            t.stop_while_waiting()
        batch, counts = got
        batch, scores, metrics = t.job.scored(batch)
        dropped, self.dropped_total = counts["dropped_total"] - self.dropped_total, counts["dropped_total"]
        metrics.update(
            buffer_metrics(counts["fill"], dropped, self.dropped_total, time.perf_counter() - start)
        )
        return batch, scores, staleness_metrics(metrics, batch, version, self.max_staleness)

    def sent(self, version: int) -> None:
        if self.trainer.spec.trainer.mode == "async":
            self.endpoint.set_version(version)

    def _pad(self) -> int:
        return self.trainer.job.tokenizer.pad_token_id or 0

    def stats(self) -> dict[str, float]:
        return self.endpoint.stats()


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
