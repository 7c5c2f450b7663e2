"""A setting that the job's path never reads is refused at submission, naming it (schema/unread.py).

Each case was accepted before and silently ignored: a critic's learning rate on a GRPO job (no critic
trains), a KL target without the KL penalty it adapts, async knobs on a sync job, multi-turn budgets
without an environment, a merged export without adapters. Each is accepted where it is read.
"""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from schema.job import JobSpec
from schema.section import STORED
from tests.api_util import tiny_job

SPLIT = {"placement": "split", "rollout": {"workers": 1}}
ASYNC = {"trainer": {"mode": "async"}, "resources": SPLIT}
LORA = {"model": {"lora": {"rank": 4}}}
# An agent-fed job (its step: rollout.external's trajectories), and the same job drawing its prompts.
EXTERNAL = {"source": "external", "external": {"group_size": 2, "trajectories_per_step": 4}}
PROMPTS = {"rollout": {"source": "prompts", "external": None}}
AT_DEFAULTS = {"rollout": {**EXTERNAL, "n": 8}, "trainer": {"prompts_per_step": 16}}

# (the ignored setting, the context that reads it, the field the 422 names)
CASES = [
    ({"algorithm": {"critic_lr": 1e-4}}, {"method": "ppo"}, "algorithm.critic_lr"),
    ({"algorithm": {"vf_clip": 0.5}}, {"method": "ppo"}, "algorithm.vf_clip"),
    ({"model": {"critic_path": "/models/critic"}}, {"method": "ppo"}, "model.critic_path"),
    ({"algorithm": {"kl_target": 0.01}}, {"algorithm": {"kl_in_reward": True}}, "algorithm.kl_target"),
    (
        {"algorithm": {"kl_reward_coef": 0.1}},
        {"algorithm": {"kl_in_reward": True}},
        "algorithm.kl_reward_coef",
    ),
    ({"algorithm": {"kl_loss_coef": 0.1}}, {"algorithm": {"use_kl_loss": True}}, "algorithm.kl_loss_coef"),
    (
        {"method": "sft", "algorithm": {"clip_ratio_high": 0.3}},
        {"method": "grpo"},
        "algorithm.clip_ratio_high",
    ),
    ({"trainer": {"max_staleness": 0}}, ASYNC, "trainer.max_staleness"),
    ({"trainer": {"buffer_size": 32}}, ASYNC, "trainer.buffer_size"),
    ({"trainer": {"partial_rollouts": True}}, ASYNC, "trainer.partial_rollouts"),
    ({"trainer": {"off_policy_correction": "tis"}}, ASYNC, "trainer.off_policy_correction"),
    (
        {"trainer": {"segment_tokens": 2}},
        {**ASYNC, "trainer": {"mode": "async", "partial_rollouts": True}},
        "trainer.segment_tokens",
    ),  # fmt: skip
    (
        {"rollout": {"max_turns": 2}},
        {"rollout": {"environment": "builtin:guess_number"}},
        "rollout.max_turns",
    ),
    (
        {"rollout": {"env_step_timeout_s": 1}},
        {"rollout": {"environment": "builtin:guess_number"}},
        "rollout.env_step_timeout_s",
    ),  # fmt: skip
    (
        {"checkpoint": {"export_merged": True}},
        {**LORA, "checkpoint": {"export_hf": True}},
        "checkpoint.export_merged",
    ),
    ({"trainer": {"mlflow_uri": "/tmp/mlruns"}}, {"trainer": {"loggers": ["mlflow"]}}, "trainer.mlflow_uri"),
    (
        {"trainer": {"tracker_project": "mine", "loggers": ["tensorboard"]}},
        {"trainer": {"loggers": ["tensorboard", "mlflow"]}},
        "trainer.tracker_project",
    ),
    (
        {"algorithm": {"advantage": "rloo", "norm_adv_by_std": False}},
        {"algorithm": {"advantage": "grpo"}},
        "algorithm.norm_adv_by_std",
    ),
    ({"algorithm": {"lam": 0.95}}, {"method": "ppo"}, "algorithm.lam"),
    ({"algorithm": {"gamma": 0.9}}, {"algorithm": {"advantage": "reinforce_pp"}}, "algorithm.gamma"),
    ({"trainer": {"rollout_lanes": "per_worker"}}, ASYNC, "trainer.rollout_lanes"),
    ({"rollout": EXTERNAL}, PROMPTS, "rollout.n"),
    ({"rollout": {**EXTERNAL, "n": 8}}, PROMPTS, "trainer.prompts_per_step"),
    (
        {**AT_DEFAULTS, "algorithm": {"dynamic_sampling": {"enabled": True}}},
        PROMPTS,
        "algorithm.dynamic_sampling",
    ),
    (
        {"reward": {"function": None, "model_path": "/models/rm", "num_workers": 2}},
        {"reward": {"function": "tests.reward_fns:digit_reward", "model_path": None}},
        "reward.num_workers",
    ),  # fmt: skip
]


def spec_with(*parts: dict) -> dict:
    """tiny_job with `parts` merged in, section by section (a later part's keys win)."""
    spec = tiny_job()
    for part in parts:
        for key, value in part.items():
            spec[key] = {**spec.get(key, {}), **value} if isinstance(value, dict) else value
    return spec


@pytest.mark.parametrize("setting,context,param", CASES, ids=[c[2] for c in CASES])
def test_a_setting_nothing_reads_on_the_jobs_path_is_refused_naming_it(setting, context, param) -> None:
    with pytest.raises(ValidationError) as err:
        JobSpec.model_validate(spec_with(setting))
    first = err.value.errors()[0]
    assert ".".join(map(str, first["loc"])) == param and "ignore" in first["msg"], first
    JobSpec.model_validate(spec_with(setting, context))


def test_sft_refuses_rl_settings_and_keeps_its_own() -> None:
    """An SFT step reads the loss's aggregation and the update's batches of `algorithm`, nothing else."""
    for algorithm, param in (({"use_kl_loss": True}, "use_kl_loss"), ({"advantage": "grpo"}, "advantage"),
                             ({"overlong": {"filter": True}}, "overlong")):  # fmt: skip
        with pytest.raises(ValidationError) as err:
            JobSpec.model_validate(spec_with({"method": "sft", "algorithm": algorithm}))
        assert err.value.errors()[0]["loc"] == ("algorithm", param)
    own = {"loss_agg_mode": "seq-mean-token-mean", "micro_batch_size": 2, "ppo_epochs": 2}
    assert JobSpec.model_validate(spec_with({"method": "sft", "algorithm": own})).algorithm.ppo_epochs == 2


def test_the_service_answers_an_unread_setting_and_an_edit_of_one_with_a_422_naming_it(unscheduled) -> None:
    with unscheduled.client() as client:
        answer = client.post("/v1/jobs", json=spec_with({"algorithm": {"kl_target": 0.01}}))
        assert answer.status_code == 422, answer.text
        error = answer.json()["error"]
        assert error["param"] == "algorithm.kl_target" and "kl_in_reward" in error["message"]
        # A queued GRPO job (this service starts no Ray) trains no critic: an edit of the critic's
        # learning rate would be applied to nothing.
        service = unscheduled.service
        job_id = service.store.create_job(JobSpec.model_validate(spec_with()), service.jobs_root).id
        edit = client.patch(f"/v1/jobs/{job_id}/hyperparameters", json={"critic_lr": 1e-4})
        assert edit.status_code == 422, edit.text
        assert edit.json()["error"]["param"] == "algorithm.critic_lr"
        assert client.patch(f"/v1/jobs/{job_id}/hyperparameters", json={"lr": 1e-4}).status_code == 200


def test_a_job_stored_before_its_setting_was_refused_still_runs_and_reads(unscheduled) -> None:
    """A spec is checked when it arrives; one read back from the store is not refused for a rule made
    after it was stored: the scheduler parses it to start (or resume) the job, and a refusal there
    would fail every scheduler pass."""
    service = unscheduled.service
    old = spec_with({"algorithm": {"kl_target": 0.01}, "trainer": {"epochs": 3}})  # both refused today
    job_id = service.store.create_job(old, service.jobs_root).id  # stored as it arrived back then
    record = service.store.get_job(job_id)
    run = service.scheduler.spec_to_run(record, own_checkpoint=False)  # what a start hands the controller
    assert (run.algorithm.kl_target, run.trainer.epochs) == (0.01, 3)
    with unscheduled.client() as client:
        got = client.get(f"/v1/jobs/{job_id}")
        assert got.status_code == 200, got.text
        assert got.json()["spec"]["algorithm"]["kl_target"] == 0.01
        assert job_id in [j["id"] for j in client.get("/v1/jobs").json()["data"]]
        assert client.post(f"/v1/jobs/{job_id}/cancel").json()["status"] == "cancelled"


def test_an_agent_fed_job_takes_the_generated_rollouts_defaults_and_a_stored_one_still_reads() -> None:
    """rollout.n and trainer.prompts_per_step size a step of generated rollouts; an external job's step
    is rollout.external.trajectories_per_step. Left at their defaults they are accepted, and a spec
    stored with other values before the rule (tiny_job's n = 4) still parses for the scheduler."""
    spec = JobSpec.model_validate(spec_with(AT_DEFAULTS))
    assert spec.rollout.source == "external" and (spec.rollout.n, spec.trainer.prompts_per_step) == (8, 16)
    stored = JobSpec.model_validate(spec_with({"rollout": EXTERNAL}), context=STORED)
    assert (stored.rollout.n, stored.trainer.prompts_per_step) == (4, 4)
