"""The `resources` section of a job: its training workers, and the rollout's own on placement 'split'.

Torch-free, like the whole schema package; JobSpec (schema/job.py) holds it.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, ValidationInfo, field_validator

from schema.section import Section


class WorkerResources(Section):
    """How many workers of one group, and what each one gets."""

    workers: int = Field(1, ge=1, le=4096, description="ranks (processes) of the worker group")
    cpus_per_worker: float | None = Field(
        None,
        ge=0.01,
        le=4096,
        description="CPUs per worker, at least 0.01 (Ray's resolution); a rank runs that many torch threads, "
        "up to the physical cores (one for a model of hidden size below 256, engines/threads.py). None: a "
        "share of the largest node's CPUs (at most its physical cores), which every worker of the job left "
        "to the default divides (training and, on placement 'split', rollout workers) after the sizes given "
        "explicitly: whole CPUs when each gets one, else a fraction; a job of defaults always fits",
    )
    gpus_per_worker: float = Field(
        0.0,
        ge=0,
        le=1024,
        description="0: one GPU per worker when the cluster has GPUs (a job whose workers outnumber them is "
        "refused: give fractions to share GPUs), none otherwise",
    )

    @field_validator("gpus_per_worker")
    @classmethod
    def _gpu_share(cls, value: float) -> float:
        if 0 < value < 0.01:
            raise ValueError("give 0 or at least 0.01 GPUs per worker")
        return value


class RolloutResourcesSpec(WorkerResources):
    """The rollout role's own workers when resources.placement is 'split' (tensor_parallel_size of
    them form one replica)."""


class ResourcesSpec(WorkerResources):
    """The training workers (`workers`, `cpus_per_worker`, `gpus_per_worker`) and where the rollout runs."""

    placement: Literal["colocated", "split"] = Field(
        "colocated",
        description="colocated: the rollout engine lives in each training process (the hybrid worker); "
        "split: the rollout role runs on its own workers (resources.rollout) and weights are sent to them",
    )
    rollout: RolloutResourcesSpec | None = Field(
        None, description="the rollout workers of placement 'split' (default: 1 worker); not with 'colocated'"
    )
    placement_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = Field(
        "PACK",
        description="Ray placement of the workers' bundles: PACK (few nodes), SPREAD (many nodes), "
        "STRICT_PACK (one node), STRICT_SPREAD (one worker per node)",
    )

    @field_validator("rollout")
    @classmethod
    def _rollout_only_split(cls, value: RolloutResourcesSpec | None, info: ValidationInfo) -> Any:
        if value is not None and info.data.get("placement") != "split":
            raise ValueError("rollout workers of their own need placement 'split'; colocated, the rollout "
                             "engine runs in the training workers")  # fmt: skip
        return value

    @property
    def rollout_workers(self) -> RolloutResourcesSpec | None:
        """The rollout role's own workers (placement 'split'), else None."""
        if self.placement != "split":
            return None
        return self.rollout or RolloutResourcesSpec()
