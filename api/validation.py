"""Checks at submission that a JobSpec's references resolve here, so a job fails at the door with the
field named rather than minutes later inside a worker: its paths are its submitter's to name
(service/owned_paths.py), and user code is imported and checked in a sandbox, never in this process.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from api.errors import APIError, invalid
from api.settings import ServeSettings
from controller import checkpoints
from controller.models import BUILTIN_MODEL_NAMES, context_length
from controller.tasks import BUILTIN_TASKS
from controller.user_code import UserCodeRefused, check_callable
from engines.models.pretrained import PACKAGED_MODELS, PackagedModelMissing, packaged_gguf
from engines.models.tiny_models import BUILTIN_MODELS
from engines.rollout import available_backends
from engines.training.lora_targets import (
    LLAMA_LINEAR,
    init_from_errors,
    linear_layers,
    llama_layers,
    module_names,
    target_errors,
)
from schema.job import JobSpec
from schema.section import changed_values, with_values
from service.files import FileError, FileStore
from service.owned_paths import OwnedPaths
from service.store import JobStore
from workers.references import is_path_reference

# a user-code field: the kind of callable it names, and the code of a refusal
USER_CODE = {
    "reward.function": ("reward", "invalid_reward_function"),
    "rollout.environment": ("environment", "invalid_environment"),
    "rollout.external.agent": ("agent", "invalid_agent"),
}


class Checker:
    """The submission checks of one service: its home, the paths each owner may name, and limits."""

    def __init__(self, settings: ServeSettings, home: Path, files: FileStore, store: JobStore) -> None:
        self.settings = settings
        self.home = home
        self.files = files
        self.paths = OwnedPaths(home, files, store, settings.shared_roots(), settings.tracker_policy())

    def folder(self, path: str | None, param: str, what: str) -> None:
        if path is not None and not _exists(Path(path) / "config.json"):  # owned (submittable checked it)
            raise invalid(
                param, f"'{path}' is not a {what} folder on the server (no config.json)", "not_found"
            )

    def checkpoint(self, path: str | None) -> None:
        """A resume_from (owned: submittable checked it) must hold a state a resume can read."""
        if path is not None:
            try:
                checkpoints.read_state(Path(path))
            except ValueError as err:
                raise invalid("checkpoint.resume_from", str(err)) from None

    def file(self, path: str | None, param: str) -> None:
        if path is not None and not _exists(Path(path), Path.is_file):
            raise invalid(param, f"no file '{path}' on the server", "not_found")

    def reward_source(self, ref: str, param: str, sees: str | None = None) -> str:
        """The reference with an upload id (of `sees`'s) resolved; a file it names must be `sees`'s to name."""
        try:
            ref = self.files.resolve_refs({"reward": {"function": ref}}, sees)["reward"]["function"]
        except FileError as err:
            raise APIError(
                422, f"{param}: {err}".replace("reward.function: ", ""), param, "not_found"
            ) from None
        if is_path_reference(ref):  # a 422 that does not say whether the path exists
            self.paths.resolve(ref.rpartition(":")[0], param, sees)
        return ref

    def user_code(self, ref: str, param: str) -> None:
        """A 422 when `ref` is not usable as the field `param` (a 'builtin:' name is looked up here, anything
        else is checked in a sandbox); its uploads and paths are resolved and owned (submittable)."""
        s, (kind, code) = self.settings, USER_CODE[param]
        try:
            why = check_callable(
                ref, kind, s.user_code_timeout_s, s.user_code_limits(), s.unsandboxed_user_code
            )
        except UserCodeRefused as err:
            raise invalid(param, str(err), "user_code_refused") from None
        if why is not None:
            raise invalid(param, why, code)

    def metadata(self, metadata: dict[str, str]) -> None:
        s = self.settings
        if len(metadata) > s.metadata_max_keys:
            why = f"{len(metadata)} keys; at most {s.metadata_max_keys} are allowed"
            raise invalid("metadata", why, "too_many_keys")
        for key, value in metadata.items():
            if len(key) > s.metadata_max_key_chars:
                why = f"key '{key[:32]}...' is longer than {s.metadata_max_key_chars} characters"
                raise invalid("metadata", why, "too_long")
            if len(value) > s.metadata_max_value_chars:
                why = f"{len(value)} characters; at most {s.metadata_max_value_chars} are allowed"
                raise invalid(f"metadata.{key}", why, "too_long")

    def submittable(self, spec: JobSpec, sees: str | None = None) -> None:
        """Refuse, with the field named, a spec whose references do not resolve here (uploads by id,
        of the submitter's own when `sees` names them)."""
        dumped = spec.model_dump()
        given = self.files.resolve_refs(dumped, sees)
        self.paths.check_spec(given, sees)  # every path is sees's to name; trackers the operator's
        spec = with_values(spec, changed_values(dumped, given))  # uploads by path; validated once, above
        m, d, r = spec.model, spec.data, spec.reward
        self.metadata(spec.metadata)
        if m.builtin is not None and m.builtin not in BUILTIN_MODEL_NAMES:
            why = f"unknown built-in model '{m.builtin}'; choose one of {list(BUILTIN_MODEL_NAMES)}"
            raise invalid("model.builtin", why)
        if m.builtin in PACKAGED_MODELS:
            try:
                packaged_gguf(PACKAGED_MODELS[m.builtin])
            except PackagedModelMissing as err:
                raise invalid("model.builtin", str(err), "extra_not_installed") from None
        self.folder(m.path, "model.path", "Hugging Face model")
        self.folder(m.critic_path, "model.critic_path", "Hugging Face model")
        self.context(spec)
        if d.train_path is None and d.builtin_task not in BUILTIN_TASKS:
            why = f"unknown task '{d.builtin_task}'; choose one of {sorted(BUILTIN_TASKS)}"
            raise invalid("data.builtin_task", why)
        self.file(d.train_path, "data.train_path")
        self.file(d.val_path, "data.val_path")
        self.folder(r.model_path, "reward.model_path", "reward model")
        self.checkpoint(spec.checkpoint.resume_from)
        if spec.method == "sft" and spec.rollout.environment is not None:
            raise invalid("rollout.environment", "SFT jobs do not roll out; remove the environment")
        external = spec.rollout.external_config
        refs = {
            "reward.function": None if spec.method == "sft" else r.function,
            "rollout.environment": spec.rollout.environment,
            "rollout.external.agent": external and external.agent,
        }
        for param, ref in refs.items():
            if ref is not None:
                self.user_code(ref, param)
        if m.lora is not None:
            self.lora(spec)
        why = available_backends().get(spec.rollout.backend)
        if why is not None:
            raise invalid("rollout.backend", why, "backend_unavailable")

    def context(self, spec: JobSpec) -> None:
        """A prompt and its response must fit the model's positions: past them a rope model degrades
        without a word, and vLLM refuses the prompt. A context that cannot be read is let through."""
        m, rollout = spec.model, spec.rollout
        if rollout.source == "external":  # the endpoint bounds each agent's call by the context itself
            return
        folder = Path(m.path).expanduser() if m.path else self.home / "models" / str(m.builtin)
        context = context_length(folder)
        if context is None and m.builtin in BUILTIN_MODELS:  # not built yet: its shape is known
            context = BUILTIN_MODELS[m.builtin].max_position_embeddings
        field, prompt = f"rollout.{rollout.response_budget_field}", spec.data.max_prompt_length
        longest = prompt + rollout.response_budget
        if context is not None and longest > context:
            why = (f"data.max_prompt_length ({prompt}) + {field} ({rollout.response_budget}) = {longest} "
                   f"tokens, past the model's context of {context}: lower one of them")  # fmt: skip
            raise invalid(field, why, "context_length_exceeded")

    def lora(self, spec: JobSpec) -> None:
        """model.lora against the base's linear layers (torch-free: safetensors headers)."""
        m, lora = spec.model, spec.model.lora
        folder = Path(m.path).expanduser() if m.path else self.home / "models" / str(m.builtin)
        layers = None
        if (folder / "config.json").exists() and any(folder.glob("*.safetensors")):
            try:
                layers = linear_layers(folder)
            except (OSError, ValueError) as err:
                param = "model.path" if m.path else "model.builtin"
                raise invalid(param, f"cannot read the model's weights: {err}", "invalid_model") from None
        elif m.builtin in BUILTIN_MODELS:  # not built yet: its shape is known
            t = BUILTIN_MODELS[m.builtin]
            layers = llama_layers(
                t.hidden_size, t.intermediate_size, t.num_layers, t.num_heads, t.num_kv_heads
            )
        # A packaged model not built yet is a Llama; a folder without safetensors is left to PEFT at start.
        names = module_names(layers) if layers is not None else LLAMA_LINEAR if m.builtin else None
        why = target_errors(lora, names) if names is not None else None
        if why is not None:
            raise invalid("model.lora.target_modules", why)
        if lora.init_from is not None and layers is not None:
            base_folder = folder if (folder / "config.json").exists() else None
            why = init_from_errors(lora, Path(lora.init_from), layers, base_folder)  # owned: submittable
            if why is not None:
                raise invalid("model.lora.init_from", why, "invalid_adapter")


def _exists(path: Path, test: Callable[[Path], bool] = Path.exists) -> bool:
    """`test(path)`, False where the name cannot be looked up at all (a component too long)."""
    try:
        return test(path)
    except OSError:
        return False
