"""A job's longest sequence (data.max_prompt_length + its response budget) against its model's context,
checked at submission (api/validation.py `Checker.context`) from the model folder's config.json, or a
built-in model's shape when it is not built yet; a context that cannot be read lets the job through."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from api.errors import APIError
from api.settings import ServeSettings
from api.validation import Checker
from controller.models import context_length
from schema.job import JobSpec
from service.files import FileStore
from service.store import JobStore


@pytest.fixture(scope="module")
def checker(tmp_path_factory) -> Checker:
    home = tmp_path_factory.mktemp("home")  # no model built here: built-ins are known by their shape
    return Checker(ServeSettings(), home, FileStore(home / "files"), JobStore(home / "tandem.db"))


def refusal(checker: Checker, **sections) -> APIError | None:
    try:
        checker.context(JobSpec.model_validate(sections))
    except APIError as err:
        return err
    return None


def model_folder(tmp_path: Path, config: object) -> dict:
    (tmp_path / "config.json").write_text(json.dumps(config))
    return {"path": str(tmp_path)}


def test_a_builtin_model_takes_exactly_its_context(checker):
    tiny = {"builtin": "tiny-qwen2"}  # 512 positions; data.max_prompt_length is 64
    assert refusal(checker, model=tiny, rollout={"max_new_tokens": 448}) is None
    err = refusal(checker, model=tiny, rollout={"max_new_tokens": 449})
    assert err is not None and err.status == 422 and err.param == "rollout.max_new_tokens"
    assert err.code == "context_length_exceeded"
    assert err.message == (
        "rollout.max_new_tokens: data.max_prompt_length (64) + rollout.max_new_tokens (449) = 513 tokens, "
        "past the model's context of 512: lower one of them"
    )
    err = refusal(checker, model=tiny, data={"max_prompt_length": 500}, rollout={"max_new_tokens": 13})
    assert err is not None and "= 513 tokens" in err.message
    big = {"builtin": "qwen2-0.5b"}  # 4096 positions
    assert refusal(checker, model=big, rollout={"max_new_tokens": 4032}) is None


def test_sft_and_multi_turn_jobs_name_their_own_budget(checker):
    tiny = {"builtin": "tiny-qwen2"}
    err = refusal(checker, method="sft", model=tiny, rollout={"max_new_tokens": 449})
    assert err is not None and err.param == "rollout.max_new_tokens"  # the response length of SFT pairs
    turns = {"environment": "builtin:calculator", "max_response_tokens": 449, "max_new_tokens": 8}
    err = refusal(checker, model=tiny, rollout=turns)
    assert err is not None and err.param == "rollout.max_response_tokens"
    assert refusal(checker, model=tiny, rollout={**turns, "max_response_tokens": 448}) is None
    # agents' calls are bounded by the job's endpoint, one at a time
    assert refusal(checker, model=tiny, rollout={"source": "external", "max_new_tokens": 4096}) is None


def test_a_model_folder_is_read_from_its_config(checker, tiny_model_dir):
    assert context_length(tiny_model_dir) == 512
    assert refusal(checker, model={"path": str(tiny_model_dir)}, rollout={"max_new_tokens": 448}) is None
    err = refusal(checker, model={"path": str(tiny_model_dir)}, rollout={"max_new_tokens": 449})
    assert err is not None and "context of 512" in err.message


@pytest.mark.parametrize(
    "config, context",
    [
        ({"model_type": "llama"}, None),  # says nothing: let through
        ({"n_positions": 1024}, 1024),
        ({"text_config": {"max_position_embeddings": 2048}, "max_position_embeddings": 64}, 2048),
        ({"max_position_embeddings": 32768, "rope_scaling": {"type": "yarn", "factor": 4.0}}, 131072),
        ({"max_position_embeddings": 8192, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, 8192),
        ({"max_position_embeddings": 512, "rope_scaling": {"type": "linear", "factor": float("inf")}}, 512),
        ({"max_position_embeddings": True}, None),  # a bool is not a length
        ({"max_position_embeddings": -5, "seq_length": 300}, 300),
        ({"max_position_embeddings": "512"}, None),
        ([1, 2, 3], None),
        ({"text_config": "x", "max_position_embeddings": 100}, 100),
    ],
)
def test_hostile_or_silent_configs(tmp_path, checker, config, context):
    model = model_folder(tmp_path, config)
    assert context_length(tmp_path) == context
    err = refusal(checker, model=model, rollout={"max_new_tokens": 1_000_000})
    assert (err is None) == (context is None)


def test_an_unreadable_config_lets_the_job_through(tmp_path, checker):
    (tmp_path / "config.json").write_text("{not json")
    assert context_length(tmp_path) is None
    (tmp_path / "config.json").write_text('{"max_position_embeddings": 8, "pad": "' + "x" * (1 << 20) + '"}')
    assert context_length(tmp_path) is None  # too large to be a config: not read
    (tmp_path / "config.json").unlink()
    (tmp_path / "config.json").mkdir()
    assert context_length(tmp_path) is None
    assert refusal(checker, model={"path": str(tmp_path)}, rollout={"max_new_tokens": 1_000_000}) is None
