"""`AgentSource`, the batch source of `rollout.source: external`: the job's endpoint actor (found again
after a restart of the workers), pointed at each attempt's rollout workers, and a step's rewarded
trajectories in the training layout of multi-turn rollouts (one row per segment, a multi-turn
`Trajectory` already, the reward as `env_rewards`, the task id as the GRPO group id).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import ray
import torch

from controller.batch_source import BatchSource, Scored, buffer_metrics, in_rounds, staleness_metrics
from controller.external import ExternalServer
from controller.external_store import Segment
from controller.trajectory_view import split_turns
from schema.async_rl import buffer_capacity, staleness_bound
from schema.external import server_name
from workers.batch import Batch
from workers.multiturn import trajectory_non_tensors, trajectory_tensors

if TYPE_CHECKING:
    from controller.trainer import Trainer

POLL_S = 0.2
CALL_TIMEOUT_S = 60.0


class AgentSource(BatchSource):
    """Sync: the first whole groups of rewarded trajectories; async: the groups young enough. The actor
    and the agent pool are kept across restarts."""

    def __init__(self, trainer: Trainer) -> None:
        self.trainer, self.config = trainer, trainer.spec.rollout.external_config
        self.actor: Any = None
        self.agents = None  # rollout.external.agent's pool
        self.dropped_total = 0
        self.max_staleness = staleness_bound(trainer.spec)

    def start(self) -> None:
        """Serve from this attempt's rollout replicas (one per tensor-parallel group), at its version."""
        t, spec = self.trainer, self.trainer.spec
        if self.actor is None:
            buffer = None  # trainer.mode async: admission by the rollout buffer, before any call is served
            if spec.trainer.mode == "async":  # step_index: a resumed job's checkpoint step, already trained
                per_step = self.config.trajectories_per_step
                buffer = (self.max_staleness, buffer_capacity(spec, per_step), t.step_index)
            self.actor = (
                ray.remote(ExternalServer)
                .options(name=server_name(t.name), get_if_exists=True, num_cpus=0, max_concurrency=10_000)
                .remote(t.name, t.job.model_path, self.config, buffer)
            )
        rollout = t.job.groups.actor.rollout.group
        replicas = rollout.actors[:: spec.rollout.tensor_parallel_size]
        ray.get(self.actor.attach.remote(replicas, t.step_index), timeout=CALL_TIMEOUT_S)
        if self.config.agent is not None and self.agents is None:  # rollout.external.agent: the job's own
            from controller.external_agents import AgentPool

            self.agents = AgentPool(self.config, self.actor, t.name)
        t.sink.event("endpoint", "the OpenAI-compatible endpoint serves this job's rollout workers")

    def close(self) -> None:
        """rollout.external.agent's pool: its thread would outlive the run in a long-lived process."""
        if self.agents is not None:
            self.agents.stop()

    def next_batch(self) -> Scored:
        if self.trainer.spec.trainer.mode == "async":
            return self._young_groups()
        return in_rounds(self.trainer, lambda _: self._trajectories())

    def _trajectories(self) -> Batch:
        rows = self._poll(self.actor.take.remote)
        return rows_batch(whole_ranks(rows, self.trainer.spec.resources.workers), self._pad())

    def _young_groups(self) -> Scored:
        """The groups trainable at the step's version (each row's `policy_version`: its trajectory's
        oldest token's), scored, with the buffer's counts."""
        t = self.trainer
        version, start = t.step_index - 1, time.perf_counter()
        with t.timed("wait_rollout"):
            counts = self._poll(lambda: self.actor.take_step.remote(version))
            rows = whole_ranks(counts.pop("rows"), t.spec.resources.workers)
            batch = rows_batch(rows, self._pad())
            batch.tensors["policy_version"] = torch.tensor([r.policy_version for r in rows], dtype=torch.long)
        batch, scores, metrics = t.job.scored(batch)
        dropped, self.dropped_total = counts["dropped_total"] - self.dropped_total, counts["dropped_total"]
        metrics.update(
            buffer_metrics(counts["fill"], dropped, self.dropped_total, time.perf_counter() - start)
        )
        return batch, scores, staleness_metrics(metrics, batch, version, self.max_staleness)

    def _poll(self, call: Any) -> Any:
        """`call()`'s answer once it is not None; a stop that arrives meanwhile stops the trainer."""
        t = self.trainer
        while (got := ray.get(call(), timeout=CALL_TIMEOUT_S)) is None:
            if t.control.stop_reason is not None:
                t.stop_while_waiting()
            time.sleep(POLL_S)
        return got

    def sent(self, version: int) -> None:
        if self.trainer.spec.trainer.mode == "async":
            ray.get(self.actor.set_version.remote(version), timeout=CALL_TIMEOUT_S)

    def _pad(self) -> int:
        return self.trainer.job.tokenizer.pad_token_id or 0

    def stats(self) -> dict[str, float]:
        stats = ray.get(self.actor.stats.remote(), timeout=CALL_TIMEOUT_S)
        return {**stats, **(self.agents.stats() if self.agents is not None else {})}


def whole_ranks(rows: list[Segment], workers: int) -> list[Segment]:
    """Every rank trains on as many rows: the earliest segments that are not a trajectory's last go."""
    extra = len(rows) % workers
    keep = []
    for i, row in enumerate(rows):
        later = i + 1 < len(rows) and rows[i + 1].trajectory_id == row.trajectory_id
        if extra and later:
            extra -= 1
            continue
        keep.append(row)
    return keep


def rows_batch(rows: list[Segment], pad: int) -> Batch:
    width = max(len(r.prompt_ids) for r in rows)
    response = max(max(len(r.tokens) for r in rows), 1)
    non_tensors = {
        **trajectory_non_tensors(rows),
        "uid": [r.task_id for r in rows],
        "prompt": [split_turns(r.messages)[0] for r in rows],
        "trajectory_id": [r.trajectory_id for r in rows],
        "segment_reason": [r.reason for r in rows],
    }
    return Batch(trajectory_tensors(rows, width, response, pad), non_tensors, {"response_budget": response})
