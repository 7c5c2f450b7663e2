"""Everything a job builds from its spec before its first step, in one build order (`JobSetup.build`:
model, tokenizer, data, reward, worker groups), then what the trainer asks of it: prompt batches with
their sampling settings and the samples' scores (`scored`).

The worker groups (`start_groups`): the job's training ranks are one `ResourcePool` (one bundle per
rank). Placement 'colocated' (the default): the hybrid actor-rollout-ref worker takes the bundles.
Placement 'split': the training role (actor + reference) takes them, the rollout role runs on a pool
of its own (resources.rollout), and the training rank 0 is connected to the rollout workers with the
strategy of `rollout.weight_transfer`. A critic (PPO with GAE) and a reward model are colocated on
the training bundles in their own actors, the groups splitting every bundle evenly. Each worker gets
its typed config (schema/workers.py, schema/engine.py), built from the JobSpec sections that inherit
its fields; the trainer talks to each group through its typed surface (controller/groups.py).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray
import torch

from controller.data import PromptLoader, build_dataset, needs_ground_truth, resolve_data_files
from controller.groups import (
    ActorGroup,
    CriticGroup,
    JobGroups,
    RewardGroup,
    RolloutPlan,
)
from controller.models import resolve_model_path
from controller.resource_pool import ResourcePool, describe_placement
from controller.rewards import RewardScorer
from controller.sink import JobSink
from controller.step_math import apply_overlong, score
from controller.trajectory_view import log_env_errors, multiturn_metrics
from controller.worker_group import PendingGroup, RayWorkerGroup, ready_all
from engines.rollout import resolve_backend
from schema.engine import EngineConfig, OptimizerConfig
from schema.job import JobSpec
from schema.section import fields_of
from schema.workers import HybridWorkerConfig, RolloutConfig, RolloutWorkerConfig
from workers.actor_role import ActorRefWorker, ActorRolloutRefWorker
from workers.batch import Batch, put_environment, put_prompt_length, put_sampling
from workers.critic import CriticWorker
from workers.reward_model import RewardModelConfig, RewardModelWorker


@dataclass
class JobSetup:
    spec: JobSpec
    model_path: str
    tokenizer: Any
    loader: PromptLoader
    val_batch: Batch | None
    scorer: RewardScorer | None  # None when a reward model scores the job
    groups: JobGroups
    # The scorer's processes serve one thread at a time (async lanes score side by side).
    scoring: threading.Lock = field(default_factory=threading.Lock)

    @classmethod
    def build(
        cls, spec: JobSpec, workdir: Path, sink: JobSink, name: str, pool: ResourcePool | None = None
    ) -> JobSetup:
        """`pool`: the training pool a restart placed while it waited, else placed here."""
        from transformers import AutoTokenizer

        model_path = resolve_model_path(spec.model)
        tokenizer = AutoTokenizer.from_pretrained(model_path)
        train_file, val_file = resolve_data_files(spec.data, workdir, seed=spec.trainer.seed)
        sft, truth = spec.method == "sft", needs_ground_truth(spec)
        train = build_dataset(train_file, tokenizer, spec.data, sft, spec.rollout.max_new_tokens, truth)
        if train.num_filtered:
            why = f"{train.num_filtered} training prompts longer than {spec.data.max_prompt_length} tokens"
            sink.event("data_filtered", f"{why} were dropped", **train.stats)
        loader = PromptLoader(train, spec.trainer.prompts_per_step, spec.trainer.seed, spec.data.shuffle)
        val_batch = None
        if val_file is not None and spec.trainer.val_every:
            val = build_dataset(val_file, tokenizer, spec.data, ground_truth=truth)
            val_batch = val.head(spec.trainer.val_size)
            put_sampling(val_batch, spec.rollout.sampling_params(seed=0, greedy=spec.trainer.val_greedy))
            put_prompt_length(val_batch, spec.data.max_prompt_length)
            put_environment(val_batch, spec.rollout.environment_config())
        scorer = RewardScorer(spec.reward.function, spec.reward.num_workers) if spec.reward.function else None
        backend = resolve_backend(spec.rollout.backend, rollout_device(spec))
        spec = spec.merged({"rollout": {"backend": backend}})
        sink.event(
            "building",
            f"starting {spec.resources.workers} worker(s) for {spec.method} on {model_path} "
            f"(rollout backend {spec.rollout.backend})",
            rollout_backend=spec.rollout.backend,
        )
        groups = start_groups(spec, model_path, name, pool)
        sink.event("workers_started", "worker groups are up", workers=spec.resources.workers)
        where = groups.pool.placement()
        sink.event(
            "placement",
            f"{describe_placement(**where)} ({len(set(where['node_ids']))} node(s), "
            f"{spec.resources.placement_strategy})",
            strategy=spec.resources.placement_strategy,
            **where,
        )
        return cls(spec, model_path, tokenizer, loader, val_batch, scorer, groups)

    def next_prompts(self, step: int, round_index: int = 0) -> Batch:
        """The step's prompts, each repeated rollout.n times (a group is contiguous); `round_index`
        counts dynamic sampling's extra draws."""
        batch = next(self.loader).repeat(self.spec.rollout.n, interleave=True)
        # A function of the step and round alone: a resumed job samples what it would have.
        seed = self.spec.trainer.seed * 1_000_003 + step + round_index * 2**32
        put_sampling(batch, self.spec.rollout.sampling_params(seed=seed))
        put_prompt_length(batch, self.spec.data.max_prompt_length)
        put_environment(batch, self.spec.rollout.environment_config())
        batch.meta["step"] = step
        return batch

    def rewards(self, batch: Batch) -> tuple[Batch, torch.Tensor, dict[str, float]]:
        """Sequence scores: the environment's (multi-turn), else the reward model's, else the rule's."""
        with self.scoring:
            if "env_rewards" in batch.tensors.keys():
                log_env_errors(batch, self.spec.rollout.environment)
                return batch, batch.tensors["env_rewards"].float(), multiturn_metrics(batch)
            if self.groups.reward is not None:
                batch = self.groups.reward.compute_rm_score(batch)
                return batch, batch.tensors["rm_scores"].float(), {}
            scores, metrics = score(batch, self.scorer, self.tokenizer)
            return batch, scores, metrics

    def scored(self, batch: Batch) -> tuple[Batch, torch.Tensor, dict[str, float]]:
        """Rewards, then the over-long options (controller/step_math.py), wherever samples came from."""
        batch, scores, metrics = self.rewards(batch)
        batch, scores, overlong = apply_overlong(
            batch, scores, self.spec.algorithm.overlong, self.spec.rollout.response_budget
        )
        return batch, scores, {**metrics, **overlong}

    def shutdown(self) -> None:
        if self.scorer is not None:
            self.scorer.close()
        self.groups.shutdown()


def rollout_device(spec: JobSpec) -> str:
    """ "cuda" when the rollout workers ask for GPUs, or the cluster has them (the resource pool's rule)."""
    split = spec.resources.rollout_workers
    gpus = split.gpus_per_worker if split is not None else spec.resources.gpus_per_worker
    return "cuda" if gpus or ray.cluster_resources().get("GPU", 0) >= 1 else "cpu"


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
        collective_timeout_s=spec.trainer.collective_timeout_s,
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


def start_groups(
    spec: JobSpec,
    model_path: str,
    name: str,
    pool: ResourcePool | None = None,
) -> JobGroups:
    """Every worker group of the job, started side by side (a group's start is mostly its processes'
    imports and model loads, which need not wait for each other's). Groups sharing GPUs start in
    turn: a vLLM or SGLang engine sizes its cache from the free GPU memory it sees while it starts."""
    pool = pool or ResourcePool.for_resources(spec.resources, name=f"{name}-pool")
    # Colocated groups split every bundle evenly.
    share = 1.0 / (1 + needs_critic(spec) + (spec.reward.model_path is not None))
    in_turn = share < 1 and pool.gpus_per_bundle > 0
    call_timeout_s = spec.trainer.call_timeout_s  # every call of a step, on every group

    def launch(worker_cls: type, config: object, role: str) -> PendingGroup:
        if in_turn:  # the groups already launched on these GPUs are up first
            for group in pending.values():
                if group.pool is pool:
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
            rollout_pool = ResourcePool.for_resources(
                spec.resources, name=f"{name}-rollout-pool", role="rollout"
            )
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
            pending["rollout"] = plan.launch(rollout_pool)
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
            plan.link(groups["actor"], groups["rollout"])
        critic = CriticGroup(groups["critic"]) if "critic" in groups else None
        reward = RewardGroup(groups["reward"]) if "reward" in groups else None
    except Exception:
        pool.remove()
        if rollout_pool is not None:
            rollout_pool.remove()
        raise
    return JobGroups(pool, actor, critic, reward, rollout_pool, plan)
