"""The trainer's side of `rollout.source: external`: the endpoint's actor (found again after a restart
of the workers), pointed at each attempt's rollout workers, and a step's rewarded trajectories in the
training layout of multi-turn rollouts (one row per segment, a multi-turn `Trajectory` already, the
reward as `env_rewards`, the task id as the GRPO group id).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import ray
import torch

from controller.external import ExternalServer
from controller.external_store import Segment
from controller.trajectory_view import split_turns
from schema.async_rl import buffer_capacity, staleness_bound
from schema.external import server_name
from schema.job import JobSpec
from workers.batch import Batch
from workers.multiturn import trajectory_non_tensors, trajectory_tensors

POLL_S = 0.2
CALL_TIMEOUT_S = 60.0


class ExternalSource:
    def __init__(self, job_id: str, spec: JobSpec, model_path: str, version: int = 0) -> None:
        self.spec, self.config, self.job_id = spec, spec.rollout.external_config, job_id
        self.agents = None  # rollout.external.agent's pool
        buffer = None  # trainer.mode async: admission by the rollout buffer, before any call is served
        if spec.trainer.mode == "async":  # `version`: a resumed job's checkpoint step, already trained
            k, per_step = staleness_bound(spec), self.config.trajectories_per_step
            buffer = (k, buffer_capacity(spec, per_step), version)
        self.actor = (
            ray.remote(ExternalServer)
            .options(name=server_name(job_id), get_if_exists=True, num_cpus=0, max_concurrency=10_000)
            .remote(job_id, model_path, self.config.model_dump(), buffer)
        )

    def attach(self, groups: Any, version: int) -> None:
        """Serve from this attempt's rollout replicas (one per tensor-parallel group), at `version`."""
        rollout = groups.actor.rollout.group
        tp = self.spec.rollout.tensor_parallel_size
        ray.get(self.actor.attach.remote(rollout.actors[::tp], version), timeout=CALL_TIMEOUT_S)
        if self.config.agent is not None and self.agents is None:  # rollout.external.agent: the job's own
            from controller.external_agents import AgentPool

            self.agents = AgentPool(self.config, self.actor, self.job_id)

    def next_batch(self, stopping: Callable[[], bool], pad: int) -> Batch | None:
        """Sync: the next step's trajectories once rewarded; None when asked to stop."""
        rows = self._poll(self.actor.take.remote, stopping)
        return None if rows is None else rows_batch(whole_ranks(rows, self.spec.resources.workers), pad)

    def next_async(self, version: int, stopping: Callable[[], bool], pad: int) -> tuple[Batch, dict] | None:
        """Async: the next step's groups trainable at `version` (each row's `policy_version`: its
        trajectory's oldest token's) and the buffer's counts; None when asked to stop."""
        got = self._poll(lambda: self.actor.take_step.remote(version), stopping)
        if got is None:
            return None
        rows = whole_ranks(got.pop("rows"), self.spec.resources.workers)
        batch = rows_batch(rows, pad)
        batch.tensors["policy_version"] = torch.tensor([r.policy_version for r in rows], dtype=torch.long)
        return batch, got

    def set_version(self, version: int) -> None:
        ray.get(self.actor.set_version.remote(version), timeout=CALL_TIMEOUT_S)

    def _poll(self, call: Callable[[], Any], stopping: Callable[[], bool]) -> Any:
        while True:
            got = ray.get(call(), timeout=CALL_TIMEOUT_S)
            if got is not None or stopping():
                return got
            time.sleep(POLL_S)

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
