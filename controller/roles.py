"""From a JobSpec to running worker groups: engine configs for each role, placed on one pool.

The job's ranks are one `ResourcePool` (one bundle per rank). The hybrid actor-rollout-ref worker
takes the bundles; a critic (PPO with GAE) and a reward model (when the job scores with one) are
colocated on the same bundles in their own actors, the groups splitting every bundle evenly.
"""

from __future__ import annotations

from dataclasses import dataclass

from controller.resource_pool import ResourcePool
from controller.spec import JobSpec
from controller.worker_group import RayWorkerGroup
from engines.config import EngineConfig
from workers.critic import CriticWorker
from workers.hybrid import ActorRolloutRefWorker, HybridWorkerConfig, RolloutConfig
from workers.reward_model import RewardModelWorker


def needs_reference(spec: JobSpec) -> bool:
    return spec.method != "sft" and (spec.algorithm.use_kl_loss or spec.algorithm.kl_in_reward)


def needs_critic(spec: JobSpec) -> bool:
    return spec.method != "sft" and spec.advantage_estimator == "gae"


def engine_config(spec: JobSpec, model_path: str, lr: float, trainable: bool = True) -> EngineConfig:
    o, a = spec.optim, spec.algorithm
    return EngineConfig(
        model_path=model_path,
        trainable=trainable,
        dtype=spec.model.dtype,
        gradient_checkpointing=spec.model.gradient_checkpointing,
        optim={"lr": lr, "betas": o.betas, "weight_decay": o.weight_decay, "grad_clip": o.grad_clip},
        scheduler={
            "kind": o.schedule,
            "warmup_steps": o.warmup_steps,
            "total_steps": spec.trainer.total_steps,
            "min_lr_ratio": o.min_lr_ratio,
        },
        micro_batch={
            "micro_batch_size": a.micro_batch_size,
            "max_tokens_per_micro_batch": a.max_tokens_per_micro_batch,
        },
        seed=spec.trainer.seed,
    )


def hybrid_config(spec: JobSpec, model_path: str) -> HybridWorkerConfig:
    r = spec.rollout
    return HybridWorkerConfig(
        actor=engine_config(spec, model_path, spec.optim.lr),
        ref=engine_config(spec, model_path, spec.optim.lr, trainable=False)
        if needs_reference(spec)
        else None,
        rollout=RolloutConfig(
            backend=r.backend,
            tensor_parallel_size=r.tensor_parallel_size,
            bucket_mb=r.bucket_mb,
            free_cache_after_generate=r.free_cache_after_generate,
            offload_trainer_during_rollout=r.offload_trainer_during_rollout,
        ),
    )


@dataclass
class JobGroups:
    """The job's placement and the worker groups on it."""

    pool: ResourcePool
    actor: RayWorkerGroup
    critic: RayWorkerGroup | None
    reward: RayWorkerGroup | None = None

    def shutdown(self) -> None:
        for group in (self.reward, self.critic, self.actor):
            if group is not None:
                group.shutdown()
        self.pool.remove()


def start_groups(spec: JobSpec, model_path: str, name: str, call_timeout_s: float = 3600.0) -> JobGroups:
    pool = ResourcePool.for_resources(spec.resources, name=f"{name}-pool")
    # Colocated groups split every bundle evenly.
    share = 1.0 / (1 + needs_critic(spec) + (spec.reward.model_path is not None))
    try:
        actor = RayWorkerGroup(
            pool,
            ActorRolloutRefWorker,
            hybrid_config(spec, model_path).model_dump(),
            group_name=f"{name}-actor",
            share=share,
            call_timeout_s=call_timeout_s,
        )
        critic = None
        if needs_critic(spec):
            critic_path = spec.model.critic_path or model_path
            critic = RayWorkerGroup(
                pool,
                CriticWorker,
                engine_config(spec, critic_path, spec.algorithm.critic_lr).model_dump(),
                group_name=f"{name}-critic",
                share=share,
                call_timeout_s=call_timeout_s,
            )
        reward = None
        if spec.reward.model_path is not None:
            reward = RayWorkerGroup(
                pool,
                RewardModelWorker,
                {"model_path": spec.reward.model_path},
                group_name=f"{name}-reward",
                share=share,
                call_timeout_s=call_timeout_s,
            )
    except Exception:
        pool.remove()
        raise
    return JobGroups(pool, actor, critic, reward)
