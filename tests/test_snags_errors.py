"""What the troubleshooting page promises about errors holds: its 401 text is the service's, and a
rule between fields answers a 422 that names the field to change, in the service's words only."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from tests.api_util import tiny_job

PAGE = Path(__file__).resolve().parents[1] / "docs" / "troubleshooting.md"


def test_the_pages_401_texts_are_the_services(unscheduled):
    page = PAGE.read_text()
    missing = httpx.get(f"{unscheduled.url}/v1/jobs", timeout=30)
    wrong = httpx.get(f"{unscheduled.url}/v1/jobs", headers={"Authorization": "Bearer tdm_nope"}, timeout=30)
    for answer in (missing, wrong):
        assert answer.status_code == 401
        assert f"`{answer.json()['error']['message']}`" in page, answer.json()


# (overrides of a valid job, the field the 422 must name)
CROSS_FIELD = [
    ({"model": {"builtin": "tiny-qwen2", "path": "/models/x"}}, "model.path"),
    ({"model": {"builtin": None}}, "model.builtin"),
    ({"model": {"builtin": None, "path": 5}}, "model.path"),  # a field called "path" is still named
    ({"data": {"builtin_task": None}}, "data.train_path"),
    ({"reward": {"function": None}}, "reward.function"),
    ({"rollout": {"external": {"group_size": 2}}}, "rollout.external"),
    ({"rollout": {"source": "external", "environment": "builtin:calculator"}}, "rollout.environment"),
    ({"trainer": {"stop_at_val_accuracy": 0.5, "val_every": 0}}, "trainer.stop_at_val_accuracy"),
    ({"method": "ppo", "algorithm": {"advantage": "grpo"}}, "algorithm.advantage"),
    ({"trainer": {"prompts_per_step": 3}, "rollout": {"n": 1}, "resources": {"workers": 2}}, "trainer.prompts_per_step"),
    ({"rollout": {"source": "external", "external": {"trajectories_per_step": 3}}},
     "rollout.external.trajectories_per_step"),
    ({"rollout": {"source": "external", "external": {"trajectories_per_step": 6, "group_size": 2}},
      "resources": {"workers": 4}}, "rollout.external.trajectories_per_step"),
    ({"algorithm": {"overlong": {"penalty_buffer": 100}}}, "algorithm.overlong.penalty_buffer"),
    ({"method": "sft", "algorithm": {"dynamic_sampling": {"enabled": True}}}, "algorithm.dynamic_sampling.enabled"),
    ({"algorithm": {"ppo_mini_batch_size": 3}}, "algorithm.ppo_mini_batch_size"),
    ({"resources": {"rollout": {"workers": 1}}}, "resources.rollout"),
    ({"metadata": {".hidden": "x"}}, "metadata"),
    ({"rollout": {"max_new_tokens": 449}}, "rollout.max_new_tokens"),  # 64 + 449 past tiny-qwen2's 512
]  # fmt: skip


@pytest.mark.parametrize(("overrides", "field"), CROSS_FIELD, ids=[f for _, f in CROSS_FIELD])
def test_a_cross_field_rule_names_its_field_without_pydantics_prefix(unscheduled, overrides, field):
    spec = tiny_job()
    for key, value in overrides.items():
        spec[key] = {**spec[key], **value} if isinstance(value, dict) and key in spec else value
    with unscheduled.client() as api:
        answer = api.post("/v1/jobs/validate", json=spec)
    error = answer.json()["error"]
    assert answer.status_code == 422 and error["param"] == field, error
    assert "Value error" not in error["message"] and error["message"].startswith(field), error
    assert error["message"].count(f"{field}:") <= 1, error  # the field is named once
