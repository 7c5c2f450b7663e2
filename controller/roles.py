"""From a JobSpec to running worker groups: each role's typed config, on its pool.

The job's training ranks are one `ResourcePool` (one bundle per rank). Placement 'colocated' (the
default): the hybrid actor-rollout-ref worker takes the bundles. Placement 'split': the training
role (actor + reference) takes them, and the rollout role runs on a pool of its own
(resources.rollout), where the "rollout" mesh then lives; the training group's rank 0 is connected
to the rollout workers with the strategy of `rollout.weight_transfer`. Either way a critic (PPO
with GAE) and a reward model (when the job scores with one) are colocated on the training bundles
in their own actors, the groups splitting every bundle evenly. Each
worker receives its config model (schema/workers.py, schema/engine.py), built from the JobSpec
sections that inherit its fields, and the trainer talks to each group through its typed surface
(controller/groups.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from controller.groups import ActorGroup, CriticGroup, RewardGroup
from controller.resource_pool import ResourcePool
from controller.worker_group import PendingGroup, RayWorkerGroup, ready_all
from schema.engine import EngineConfig, OptimizerConfig
from schema.job import JobSpec
from schema.section import fields_of
from schema.workers import HybridWorkerConfig, RolloutConfig, RolloutWorkerConfig
from workers.actor_role import ActorRefWorker
from workers.critic import CriticWorker
from workers.actor_role import ActorRolloutRefWorker
from workers.reward_model import RewardModelConfig, RewardModelWorker
from workers.rollout_role import RolloutWorker
from workers.transfer_choice import RolloutLink

TRANSFER_TIMEOUT_S = 300.0  # one weight transfer to the rollout workers, or forming its group


def needs_reference(spec: JobSpec) -> bool:
    return spec.method != "sft" and (spec.algorithm.use_kl_loss or spec.algorithm.kl_in_reward)


def needs_critic(spec: JobSpec) -> bool:
    return spec.method != "sft" and spec.advantage_estimator == "gae"


def engine_config(
    spec: JobSpec, model_path: str, optim: OptimizerConfig, trainable: bool = True
) -> EngineConfig:
    """`optim`: the job's `optim` section itself (an OptimizerConfig), or a copy with the critic's lr."""
    return EngineConfig(
        model_path=model_path,
        trainable=trainable,
        dtype=spec.model.dtype,
        gradient_checkpointing=spec.model.gradient_checkpointing,
        optim=optim,
        scheduler=spec.optim.scheduler_config(spec.trainer.total_steps),
        micro_batch=spec.algorithm.micro_batch_config(),
        seed=spec.trainer.seed,
    )


def hybrid_config(spec: JobSpec, model_path: str) -> HybridWorkerConfig:
    actor = engine_config(spec, model_path, spec.optim).model_copy(update={"lora": spec.model.lora})
    # With LoRA the reference is the actor with its adapters switched off: no second model.
    separate_ref = needs_reference(spec) and spec.model.lora is None
    return HybridWorkerConfig(
        actor=actor,
        ref=engine_config(spec, model_path, spec.optim, trainable=False) if separate_ref else None,
        rollout=fields_of(spec.rollout, RolloutConfig, dtype=spec.model.dtype),
    )


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

    def set_learning_rates(self, spec: JobSpec) -> None:
        """The spec's learning rates, now (an edit, or over a checkpoint's)."""
        self.actor.set_learning_rate(spec.optim.lr)
        if self.critic is not None:
            self.critic.set_learning_rate(spec.algorithm.critic_lr)

    def replace_rollout(self, start_timeout_s: float) -> None:
        """Placement 'split': a new rollout group on the rollout pool in place of the old one (killed,
        one of its workers having died), and the training rank 0 connected to it anew. The training
        ranks keep their processes; the new workers hold the base weights until the next sync."""
        if self.rollout_pool is None or self.rollout_plan is None:
            raise RuntimeError("only a split placement's rollout group can be replaced on its own")
        self.actor.rollout.shutdown()  # the survivors too: the new group is formed whole
        rollout = start_rollout(self.rollout_pool, self.rollout_plan, start_timeout_s)
        try:
            link_rollout(self.actor.group, rollout, self.rollout_plan)
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


def start_groups(spec: JobSpec, model_path: str, name: str, call_timeout_s: float = 3600.0) -> JobGroups:
    """Every worker group of the job, started side by side (a group's start is mostly its processes'
    imports and model loads, which need not wait for each other's). Groups sharing GPUs start in
    turn: a vLLM or SGLang engine sizes its cache from the free GPU memory it sees while it starts."""
    pool = ResourcePool.for_resources(spec.resources, name=f"{name}-pool")
    # Colocated groups split every bundle evenly.
    share = 1.0 / (1 + needs_critic(spec) + (spec.reward.model_path is not None))
    in_turn = share < 1 and pool.gpus_per_bundle > 0

    def launch(worker_cls: type, config: object, role: str) -> PendingGroup:
        if in_turn:  # the groups already launched on these GPUs are up first
            for group in pending.values():
                if group.hosts.pool is pool:
                    group.wait()
        return RayWorkerGroup.launch(
            pool, worker_cls, config, group_name=f"{name}-{role}", share=share, call_timeout_s=call_timeout_s
        )

    rollout_pool = plan = None
    pending: dict[str, PendingGroup] = {}
    try:
        config = hybrid_config(spec, model_path)
        if spec.resources.rollout_workers is None:
            pending["actor"] = launch(ActorRolloutRefWorker, config, "actor")
        else:
            rollout_pool = rollout_pool_of(spec, name)
            plan = RolloutPlan(
                RolloutWorkerConfig(
                    model_path=model_path,
                    rollout=config.rollout,
                    lora_rank=spec.model.lora.rank if spec.model.lora is not None else None,
                ),
                f"{name}-rollout",
                spec.rollout.weight_transfer,
                call_timeout_s,
            )
            pending["rollout"] = launch_rollout(rollout_pool, plan)
            pending["actor"] = launch(ActorRefWorker, config, "actor")
        if needs_critic(spec):
            critic_optim = spec.optim.model_copy(update={"lr": spec.algorithm.critic_lr})
            critic_config = engine_config(spec, spec.model.critic_path or model_path, critic_optim)
            pending["critic"] = launch(CriticWorker, critic_config, "critic")
        if spec.reward.model_path is not None:
            reward_config = RewardModelConfig(model_path=spec.reward.model_path)
            pending["reward"] = launch(RewardModelWorker, reward_config, "reward")
        groups = ready_all(pending)
        if plan is None:
            actor = ActorGroup(groups["actor"])
        else:
            actor = ActorGroup(groups["actor"], groups["rollout"])
            link_rollout(groups["actor"], groups["rollout"], plan)
        critic = CriticGroup(groups["critic"]) if "critic" in groups else None
        reward = RewardGroup(groups["reward"]) if "reward" in groups else None
    except Exception:
        pool.remove()
        if rollout_pool is not None:
            rollout_pool.remove()
        raise
    return JobGroups(pool, actor, critic, reward, rollout_pool, plan)


@dataclass(frozen=True)
class RolloutPlan:
    """How a split placement's rollout group is started and linked: kept to start a replacement."""

    config: RolloutWorkerConfig
    name: str  # the group's name (errors and events name it)
    strategy: str  # rollout.weight_transfer
    call_timeout_s: float


def start_rollout(pool: ResourcePool, plan: RolloutPlan, start_timeout_s: float = 300.0) -> RayWorkerGroup:
    """The rollout workers of a split placement, on their own pool."""
    return launch_rollout(pool, plan, start_timeout_s).ready()


def launch_rollout(pool: ResourcePool, plan: RolloutPlan, start_timeout_s: float = 300.0) -> PendingGroup:
    return RayWorkerGroup.launch(
        pool,
        RolloutWorker,
        plan.config,
        group_name=plan.name,
        call_timeout_s=plan.call_timeout_s,
        start_timeout_s=start_timeout_s,
    )


def link_rollout(training: RayWorkerGroup, rollout: RayWorkerGroup, plan: RolloutPlan) -> None:
    """Connect the training rank 0 to `rollout` with the plan's strategy (a collective group is formed
    with its workers; an earlier one is closed first, workers/actor_role.py)."""
    timeout_s = min(plan.call_timeout_s, TRANSFER_TIMEOUT_S)
    training.connect_rollout(RolloutLink(rollout.actors, rollout.name, plan.strategy, timeout_s))


def rollout_pool_of(spec: JobSpec, name: str) -> ResourcePool:
    """The rollout workers' own pool (placement 'split'), with resources.rollout's sizes."""
    return ResourcePool.for_resources(spec.resources, name=f"{name}-rollout-pool", role="rollout")
