"""The multi-turn settings are declared once (schema.workers.EnvironmentOptions): the JobSpec's
rollout section inherits them with their bounds, the worker's EnvironmentConfig is built from it,
and they travel in a batch's meta through one typed pair of functions, as the prompt width does."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from schema.job import JobSpec
from schema.workers import EnvironmentConfig, EnvironmentOptions
from workers.batch import Batch, environment_of, prompt_length_of, put_environment, put_prompt_length

MULTI_TURN = {
    "environment": "builtin:guess_number",
    "max_turns": 3,
    "max_response_tokens": 96,
    "env_step_timeout_s": 2.5,
}


def test_the_rollout_section_keeps_its_keys_and_hands_down_the_worker_model():
    spec = JobSpec.model_validate({"rollout": MULTI_TURN})
    assert set(EnvironmentOptions.model_fields) <= set(type(spec.rollout).model_fields)
    config = spec.rollout.environment_config()
    assert config == EnvironmentConfig(**MULTI_TURN)
    assert config.threads == 32  # a worker setting, not a JobSpec key
    assert JobSpec.model_validate({}).rollout.environment_config() is None
    # The bounds are the one declaration's, at submission.
    with pytest.raises(ValidationError, match="rollout.max_turns"):
        JobSpec.model_validate({"rollout": {**MULTI_TURN, "max_turns": 0}})
    # The worker model's former names are accepted there, not in a JobSpec.
    assert EnvironmentConfig(ref="builtin:guess_number", step_timeout_s=2.5).env_step_timeout_s == 2.5
    with pytest.raises(ValidationError, match="rollout.ref"):
        JobSpec.model_validate({"rollout": {"ref": "builtin:guess_number"}})
    with pytest.raises(ValidationError, match="needs an environment"):
        EnvironmentConfig()


def test_environment_and_prompt_width_travel_typed_in_meta():
    batch = Batch.from_dict({"x": torch.zeros(4, 1)})
    assert environment_of(batch) is None and prompt_length_of(batch) is None
    put_environment(batch, EnvironmentConfig(**MULTI_TURN))
    put_prompt_length(batch, 48)
    for chunk in batch.chunk(2):
        assert environment_of(chunk) == EnvironmentConfig(**MULTI_TURN)
        assert prompt_length_of(chunk) == 48
    batch.meta["environment"] = {"ref": "builtin:calculator", "max_turns": 2}  # a script's dict
    assert environment_of(batch) == EnvironmentConfig(environment="builtin:calculator", max_turns=2)
    batch.meta["environment"] = {"environment": "builtin:calculator", "max_turn": 2}
    with pytest.raises(ValidationError, match="max_turn"):
        environment_of(batch)
    with pytest.raises(ValueError, match="max_prompt_length must be positive"):
        put_prompt_length(batch, 0)
