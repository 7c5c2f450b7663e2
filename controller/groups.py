"""The job's worker groups as the trainer sees them: each role's typed surface, one line per operation
derived from the worker method (`update_actor = operation(ActorRefWorker.update_actor)`, checked at
start, controller/worker_group.py), and `JobGroups`, what concerns all of them: checkpoints, replacing
a split placement's rollout group, shutting down. controller/job_setup.py starts them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from controller.resource_pool import ResourcePool
from controller.worker_group import PendingGroup, RayWorkerGroup, RoleGroup, operation
from schema.workers import RolloutWorkerConfig
from workers.actor_role import ActorRefWorker
from workers.batch import Batch
from workers.critic import CriticWorker
from workers.operations import TrainingOperations
from workers.reward_model import RewardModelWorker
from workers.rollout_role import RolloutWorker
from workers.transfer_choice import RolloutLink

TRANSFER_TIMEOUT_S = 300.0  # one weight transfer to the rollout workers, or forming its group


class CheckpointedGroup(RoleGroup):
    """A training role (workers/operations.py): checkpoints, live edits and fine-grained operations."""

    save_checkpoint = operation(TrainingOperations.save_checkpoint)
    load_checkpoint = operation(TrainingOperations.load_checkpoint)
    set_hyperparameters = operation(TrainingOperations.set_hyperparameters)
    forward_backward = operation(TrainingOperations.forward_backward)
    optim_step = operation(TrainingOperations.optim_step)
    lr_scheduler_step = operation(TrainingOperations.lr_scheduler_step)
    forward = operation(TrainingOperations.forward)
    save_state = operation(TrainingOperations.save_state)
    load_state = operation(TrainingOperations.load_state)


class RolloutGroup(RoleGroup):
    """The rollout role: in the hybrid worker, or on its own workers (placement 'split')."""

    generate_sequences = operation(RolloutWorker.generate_sequences)
    generate = operation(RolloutWorker.generate)


class ActorGroup(CheckpointedGroup):
    """The actor and its rollout: the hybrid worker, or the training role beside a rollout group of its
    own (placement 'split'), to which its rank 0 sends the weights."""

    compute_log_prob = operation(ActorRefWorker.compute_log_prob)
    compute_ref_log_prob = operation(ActorRefWorker.compute_ref_log_prob)
    update_actor = operation(ActorRefWorker.update_actor)
    update_sft = operation(ActorRefWorker.update_sft)
    sync_weights = operation(ActorRefWorker.sync_weights)
    export_hf = operation(ActorRefWorker.export_hf)

    def __init__(self, group: RayWorkerGroup, rollout: RayWorkerGroup | None = None) -> None:
        super().__init__(group)
        self.rollout = RolloutGroup(rollout or group)
        self._own_rollout = rollout is not None

    def generate_sequences(self, prompts: Batch) -> Batch:
        return self.rollout.generate_sequences(prompts)

    def set_rollout(self, rollout: RayWorkerGroup) -> None:
        """A replacement rollout group of its own (placement 'split')."""
        self.rollout, self._own_rollout = RolloutGroup(rollout), True

    @property
    def own_rollout(self) -> RayWorkerGroup | None:
        """The rollout group placed apart, or None when the workers are hybrid."""
        return self.rollout.group if self._own_rollout else None

    def start_sync_weights(self) -> Callable[[], dict[str, float]]:
        return self.start(ActorGroup.sync_weights)

    def shutdown(self) -> None:
        if self._own_rollout:
            self.rollout.shutdown()
        super().shutdown()


class CriticGroup(CheckpointedGroup):
    compute_values = operation(CriticWorker.compute_values)
    update_critic = operation(CriticWorker.update_critic)


class RewardGroup(RoleGroup):
    compute_rm_score = operation(RewardModelWorker.compute_rm_score)


@dataclass
class JobGroups:
    """The job's placement and the worker groups on it."""

    pool: ResourcePool
    actor: ActorGroup
    critic: CriticGroup | None
    reward: RewardGroup | None = None
    rollout_pool: ResourcePool | None = None  # placement 'split': the rollout workers' own pool
    rollout_plan: RolloutPlan | None = field(default=None, repr=False)  # placement 'split': to replace it

    def save_checkpoint(self, folder: str, step: int) -> None:
        """Every training role writes its engine state under `folder` (actor/, critic/)."""
        self.actor.save_checkpoint(folder, step)
        if self.critic is not None:
            self.critic.save_checkpoint(folder, step)

    def load_checkpoint(self, folder: str) -> None:
        self.actor.load_checkpoint(folder)
        if self.critic is not None:
            self.critic.load_checkpoint(folder)

    def replace_rollout(self, start_timeout_s: float) -> None:
        """Placement 'split': a new rollout group on the rollout pool in place of the old one (killed,
        one of its workers having died), and the training rank 0 connected to it anew. The training
        ranks keep their processes; the new workers hold the base weights until the next sync."""
        if self.rollout_pool is None or self.rollout_plan is None:
            raise RuntimeError("only a split placement's rollout group can be replaced on its own")
        self.actor.rollout.shutdown()  # the survivors too: the new group is formed whole
        rollout = self.rollout_plan.launch(self.rollout_pool, start_timeout_s).ready()
        try:
            self.rollout_plan.link(self.actor.group, rollout)
        except Exception:
            rollout.shutdown()
            raise
        self.actor.set_rollout(rollout)

    def shutdown(self) -> None:
        for group in (self.reward, self.critic, self.actor):
            if group is not None:
                group.shutdown()
        self.pool.remove()
        if self.rollout_pool is not None:
            self.rollout_pool.remove()


@dataclass(frozen=True)
class RolloutPlan:
    """How a split placement's rollout group is started and linked: kept to start a replacement."""

    config: RolloutWorkerConfig
    name: str  # the group's name (errors and events name it)
    strategy: str  # rollout.weight_transfer
    call_timeout_s: float

    def launch(self, pool: ResourcePool, start_timeout_s: float = 300.0) -> PendingGroup:
        """The rollout workers, on their own pool."""
        return RayWorkerGroup.launch(
            pool,
            RolloutWorker,
            self.config,
            group_name=self.name,
            call_timeout_s=self.call_timeout_s,
            start_timeout_s=start_timeout_s,
        )

    def link(self, training: RayWorkerGroup, rollout: RayWorkerGroup) -> None:
        """Connect the training rank 0 to `rollout` with the plan's strategy (a collective group is
        formed with its workers; an earlier one is closed first, workers/actor_role.py)."""
        # Half the sync call's limit: the sender's wait for a silent receiver, and its naming, end within it.
        timeout_s = min(self.call_timeout_s / 2, TRANSFER_TIMEOUT_S)
        link = RolloutLink(rollout.actors, rollout.name, self.strategy, timeout_s, rollout.hosts)
        training.connect_rollout(link)
