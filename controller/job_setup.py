"""Everything a job builds before its first step, in one build order (`JobSetup.build`: model,
tokenizer, data, reward, worker groups), then what the trainer asks of it: prompt batches with their
sampling settings, the samples' scores (`scored`), and hyper-parameter edits.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray
import torch

from controller.data import PromptLoader, build_dataset, resolve_data_files
from controller.hyperparameters import hyperparameter_overrides
from controller.models import resolve_model_path
from controller.resource_pool import describe_placement
from controller.rewards import RewardScorer
from controller.roles import JobGroups, needs_reference, start_groups
from controller.sink import JobSink
from controller.step_math import apply_overlong, score
from controller.trajectory_view import log_env_errors, multiturn_metrics
from engines.rollout import resolve_backend
from schema.job import JobSpec
from workers.batch import Batch, put_environment, put_prompt_length, put_sampling


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
    def build(cls, spec: JobSpec, workdir: Path, sink: JobSink, name: str) -> JobSetup:
        from transformers import AutoTokenizer

        model_path = resolve_model_path(spec.model)
        tokenizer = AutoTokenizer.from_pretrained(model_path)
        train_file, val_file = resolve_data_files(spec.data, workdir, seed=spec.trainer.seed)
        sft = spec.method == "sft"
        train = build_dataset(train_file, tokenizer, spec.data, sft, spec.rollout.max_new_tokens)
        if train.num_filtered:
            why = f"{train.num_filtered} training prompts longer than {spec.data.max_prompt_length} tokens"
            sink.event("data_filtered", f"{why} were dropped", **train.stats)
        loader = PromptLoader(train, spec.trainer.prompts_per_step, spec.trainer.seed, spec.data.shuffle)
        val_batch = None
        if val_file is not None and spec.trainer.val_every:
            val = build_dataset(val_file, tokenizer, spec.data)
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
        groups = start_groups(spec, model_path, name)
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

    @property
    def uses_reference(self) -> bool:
        return needs_reference(self.spec)

    @property
    def epoch(self) -> int:
        return self.loader.epoch

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
            scores, metrics, _ = score(batch, self.scorer, self.tokenizer)
            return batch, scores, metrics

    def scored(self, batch: Batch) -> tuple[Batch, torch.Tensor, dict[str, float]]:
        """Rewards, then the over-long options (controller/step_math.py), wherever samples came from."""
        batch, scores, metrics = self.rewards(batch)
        batch, scores, overlong = apply_overlong(
            batch, scores, self.spec.algorithm.overlong, self.spec.rollout.response_budget
        )
        return batch, scores, {**metrics, **overlong}

    def next_sft_batch(self) -> Batch:
        return next(self.loader)

    def apply_hyperparameters(self, spec: JobSpec, changes: dict[str, Any]) -> JobSpec:
        """A validated spec with the edits; learning rates go to the workers now."""
        new = spec.merged(hyperparameter_overrides(changes))
        if "lr" in changes:
            self.groups.actor.set_learning_rate(new.optim.lr)
        if "critic_lr" in changes and self.groups.critic is not None:
            self.groups.critic.set_learning_rate(new.algorithm.critic_lr)
        self.spec = new
        return new

    def shutdown(self) -> None:
        if self.scorer is not None:
            self.scorer.close()
        self.groups.shutdown()


def rollout_device(spec: JobSpec) -> str:
    """ "cuda" when the rollout workers ask for GPUs, or the cluster has them (the resource pool's rule)."""
    split = spec.resources.rollout_workers
    gpus = split.gpus_per_worker if split is not None else spec.resources.gpus_per_worker
    return "cuda" if gpus or ray.cluster_resources().get("GPU", 0) >= 1 else "cpu"
