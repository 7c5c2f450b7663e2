"""Checks at submission that a JobSpec's references resolve here, so a job fails at the door, with
the field named, rather than minutes later inside a worker."""

from __future__ import annotations

from pathlib import Path

from api.errors import APIError
from controller.models import BUILTIN_MODEL_NAMES
from controller.rewards import RewardFunctionError, load_reward_fn
from controller.spec import JobSpec
from controller.tasks import BUILTIN_TASKS
from engines.pretrained import PACKAGED_MODELS, PackagedModelMissing, packaged_gguf
from engines.rollout import available_backends


def _folder(path: str, param: str, what: str) -> None:
    if not (Path(path).expanduser() / "config.json").exists():
        raise APIError(422, f"{param}: '{path}' is not a {what} folder on the server (no config.json)", param,
                       "not_found")  # fmt: skip


def _file(path: str | None, param: str) -> None:
    if path is not None and not Path(path).expanduser().is_file():
        raise APIError(422, f"{param}: no file '{path}' on the server", param, "not_found")


def check_submittable(spec: JobSpec) -> None:
    m, d, r = spec.model, spec.data, spec.reward
    if m.builtin is not None and m.builtin not in BUILTIN_MODEL_NAMES:
        raise APIError(422, f"model.builtin: unknown built-in model '{m.builtin}'; choose one of "
                       f"{list(BUILTIN_MODEL_NAMES)}", "model.builtin", "invalid_value")  # fmt: skip
    if m.builtin in PACKAGED_MODELS:
        try:
            packaged_gguf(PACKAGED_MODELS[m.builtin])
        except PackagedModelMissing as err:
            raise APIError(422, f"model.builtin: {err}", "model.builtin", "extra_not_installed") from None
    if m.path is not None:
        _folder(m.path, "model.path", "Hugging Face model")
    if m.critic_path is not None:
        _folder(m.critic_path, "model.critic_path", "Hugging Face model")
    if d.train_path is None and d.builtin_task not in BUILTIN_TASKS:
        raise APIError(422, f"data.builtin_task: unknown task '{d.builtin_task}'; choose one of "
                       f"{sorted(BUILTIN_TASKS)}", "data.builtin_task", "invalid_value")  # fmt: skip
    _file(d.train_path, "data.train_path")
    _file(d.val_path, "data.val_path")
    if r.function is not None and spec.method != "sft":
        try:
            load_reward_fn(r.function)
        except RewardFunctionError as err:
            raise APIError(
                422, f"reward.function: {err}", "reward.function", "invalid_reward_function"
            ) from None
    if r.model_path is not None:
        _folder(r.model_path, "reward.model_path", "reward model")
    why = available_backends().get(spec.rollout.backend)
    if why is not None:
        raise APIError(422, f"rollout.backend: {why}", "rollout.backend", "backend_unavailable")
