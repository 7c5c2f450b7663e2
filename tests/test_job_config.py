"""One source of configuration: JobSpec sections inherit the lower layers' models, so a setting is
declared and validated once, checked at submission, and arrives typed where it is used."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from api.cli_spec import SpecError, validate
from controller.groups import ActorGroup, CriticGroup, RewardGroup
from controller.job_setup import engine_config, hybrid_config
from engines.rollout import ROLLOUT_ENGINES, SamplingParams
from engines.training.registry import EngineEntry
from schema.engine import EngineConfig, MicroBatchConfig, OptimizerConfig, SchedulerConfig
from schema.job import JobSpec
from schema.losses import PolicyLossConfig
from schema.workers import RolloutConfig, UpdateSchedule
from workers.actor_role import ActorRolloutRefWorker
from workers.base import registered_methods
from workers.batch import Batch, put_sampling, sampling_of
from workers.critic import CriticWorker
from workers.reward_model import RewardModelWorker


def spec(**sections) -> JobSpec:
    return JobSpec.model_validate(sections)


# ---- the defects ------------------------------------------------------------------------------


def test_both_micro_batch_settings_are_refused_at_submission_naming_them():
    raw = {"algorithm": {"micro_batch_size": 4, "max_tokens_per_micro_batch": 512}}
    with pytest.raises(ValidationError) as err:
        JobSpec.model_validate(raw)
    first = err.value.errors()[0]
    assert first["loc"] == ("algorithm",)
    assert "micro_batch_size and max_tokens_per_micro_batch are exclusive" in first["msg"]
    # The CLI (and the API's 422) name the section and the two fields.
    with pytest.raises(SpecError, match=r"algorithm: micro_batch_size and max_tokens_per_micro_batch"):
        validate(raw)
    # Each alone is accepted and reaches the engine's micro-batch config.
    one = spec(algorithm={"max_tokens_per_micro_batch": 512})
    assert engine_config(one, "/m", one.optim).micro_batch == MicroBatchConfig(max_tokens_per_micro_batch=512)


def test_model_dtype_reaches_the_rollout_engine_config():
    cfg = hybrid_config(spec(model={"builtin": "qwen2-1m", "dtype": "bfloat16"}), "/m")
    assert cfg.rollout.dtype == "bfloat16" and cfg.actor.dtype == "bfloat16"
    assert hybrid_config(spec(), "/m").rollout.dtype == "auto"


def test_the_tensor_parallel_rule_is_the_backend_registrys(monkeypatch):
    for build, name in (
        (lambda: spec(rollout={"tensor_parallel_size": 2}, resources={"workers": 2}), "auto"),
        (lambda: RolloutConfig(backend="hf", tensor_parallel_size=2), "hf"),
    ):
        with pytest.raises(ValidationError, match=f"rollout backend '{name}' .*on one device"):
            build()
    # A backend registered as tensor-parallel is accepted everywhere, with no other change.
    monkeypatch.setitem(
        ROLLOUT_ENGINES._entries, "tp-test", EngineEntry("tp-test", dict, tensor_parallel=True)
    )
    job = spec(rollout={"backend": "tp-test", "tensor_parallel_size": 2}, resources={"workers": 2})
    assert hybrid_config(job, "/m").rollout.tensor_parallel_size == 2
    assert spec(rollout={"backend": "sglang", "tensor_parallel_size": 2}, resources={"workers": 2})
    with pytest.raises(ValidationError, match="rollout.backend"):
        spec(rollout={"backend": "nonesuch"})


# ---- settings arrive typed ----------------------------------------------------------------------


def test_engine_configs_come_from_the_spec_sections():
    job = spec(
        optim={"lr": 3e-4, "betas": [0.8, 0.9], "grad_clip": 0.5, "schedule": "cosine", "warmup_steps": 2,
               "min_lr_ratio": 0.1},
        algorithm={"micro_batch_size": 2, "critic_lr": 7e-5, "advantage": "gae"},
        method="ppo",
        trainer={"total_steps": 9, "seed": 4},
    )  # fmt: skip
    actor = engine_config(job, "/m", job.optim)
    assert actor.optim is job.optim  # the section itself: not re-wrapped or validated again
    engine_fields = actor.optim.model_dump(include=set(OptimizerConfig.model_fields))
    assert engine_fields == OptimizerConfig(lr=3e-4, betas=(0.8, 0.9), grad_clip=0.5).model_dump()
    assert actor.scheduler == SchedulerConfig(kind="cosine", warmup_steps=2, min_lr_ratio=0.1, total_steps=9)
    assert actor.micro_batch.micro_batch_size == 2 and actor.seed == 4
    critic = engine_config(job, "/m", job.optim.model_copy(update={"lr": job.algorithm.critic_lr}))
    assert critic.optim.lr == 7e-5 and job.optim.lr == 3e-4
    assert isinstance(actor, EngineConfig)


def test_the_policy_loss_and_the_update_schedule_are_typed():
    job = spec(
        algorithm={"policy_loss": "gspo", "clip_ratio_high": 0.3, "ppo_epochs": 2, "ppo_mini_batch_size": 8}
    )
    loss = job.algorithm.policy_loss_config()
    assert type(loss) is PolicyLossConfig and loss.policy_loss == "gspo" and loss.clip_ratio_high == 0.3
    assert job.algorithm.update_schedule(seed=5) == UpdateSchedule(mini_batch_size=8, epochs=2, seed=5)
    with pytest.raises(ValidationError, match="epoch"):  # a misspelled key no longer falls back silently
        UpdateSchedule.model_validate({"epoch": 2})


def test_sampling_settings_are_written_and_read_in_one_place():
    job = spec(rollout={"temperature": 0.7, "top_k": 5, "max_new_tokens": 12, "n": 4})
    params = job.rollout.sampling_params(seed=11)
    assert params == SamplingParams(temperature=0.7, top_k=5, max_new_tokens=12, n=1, seed=11)
    assert job.rollout.sampling_params(seed=0, greedy=True).temperature == 0.0
    batch = Batch.from_dict({"x": torch.tensor([[1], [2]])}, non_tensors={"prompt": ["a", "b"]})
    put_sampling(batch, params)
    chunks = batch.chunk(2)
    assert [sampling_of(c) for c in chunks] == [params, params]
    batch.meta["sampling"] = {"temperature": 0.5}  # a script's dict is validated by the same model
    assert sampling_of(batch) == SamplingParams(temperature=0.5)
    batch.meta["sampling"] = {"temprature": 0.5}
    with pytest.raises(ValidationError, match="temprature"):
        sampling_of(batch)


def test_each_group_surface_forwards_only_methods_its_worker_registers():
    for surface, worker in ((ActorGroup, ActorRolloutRefWorker), (CriticGroup, CriticWorker),
                            (RewardGroup, RewardModelWorker)):  # fmt: skip
        assert set(surface.operations) <= set(registered_methods(worker)), surface.__name__
