"""The Tinker API's training side: sessions, training models and their work, checked before queued.

Every request is checked here, in the API process, before anything is stored or queued (a bad one
is a `TinkerError`: a 4xx naming the field, in the SDK's error shape); then its work becomes one op
of the contract's `run_batch` (docs/ARCHITECTURE.md, "Tinker API"), queued on its base model's host
under the caller's owner, and the caller gets a future. The sampling side is service/tinker_sampling.py.
"""

from __future__ import annotations

import re
import threading
import time
from pathlib import Path
from typing import Any

from engines.tinker_loss_spec import LossInputError, check_request
from service.job_state import JobStatus
from service.quotas import QuotaBook
from service.store import JobStore
from service.tinker_futures import Future, FutureTable
from service.tinker_hosts import Host, HostOptions, Op
from service.tinker_requests import (
    CreateModel,
    LoadWeights,
    LoraConfig,
    OptimizerConfig,
    OptimStep,
    SaveWeights,
    TinkerError,
)
from service.tinker_sessions import (
    METHOD,
    ClientSession,
    Records,
    TrainingModel,
    checkpoint_folder,
    last_saved_state,
    lost_message,
    parse_tinker_path,
)
from service.tinker_wire import write_forward_backward_output

NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
BUILTIN_CONTEXT = 512
SESSION_TTL_S = 600.0  # a session without a heartbeat for this long ends


def not_found(what: str, ident: str, field: str) -> TinkerError:
    return TinkerError(404, f"{field}: no {what} '{ident}' (or it is another owner's)", field)


class TinkerService:
    def __init__(self, store: JobStore, home: Path, quotas: QuotaBook, base_models: list[str],
                 options: HostOptions | None = None, runtime_env: dict | None = None) -> None:  # fmt: skip
        self.store, self.home, self.quotas = store, Path(home), quotas
        self.options = options or HostOptions()
        self.futures = FutureTable()
        self.records = Records()
        self.hosts = {
            name: Host(name, self.home / "tinker" / "hosts" / _safe(name), self.futures, self.options, runtime_env)
            for name in base_models
        }  # fmt: skip
        self._admit = threading.Lock()
        self.session_ttl_s = SESSION_TTL_S

    def shutdown(self) -> None:
        for host in self.hosts.values():
            host.stop()

    # ---- sessions ---------------------------------------------------------------------------------

    def expire_sessions(self) -> list[str]:
        """Sessions without a heartbeat for `session_ttl_s` end (the SDK beats every 10 s): their
        models leave the host and their rows are paused, naming the last saved state."""
        now = time.time()
        gone = [
            s for s in list(self.records.sessions.values()) if now - s.last_heartbeat > self.session_ttl_s
        ]
        for session in gone:
            self.records.sessions.pop(session.id, None)
            for model in [m for m in list(self.records.models.values()) if m.session_id == session.id]:
                self.records.drop_model(model.model_id)
                last = last_saved_state(model.job_id, model.workdir) or "none (no save_state)"
                why = (f"session {session.id} ended: no heartbeat for {self.session_ttl_s:g} s; "
                       f"the last saved state of training run {model.job_id} is {last}")  # fmt: skip
                self.store.transition(model.job_id, (JobStatus.RUNNING,), JobStatus.PAUSED, error=why)
                self.store.add_event(model.job_id, "paused", why)
                body = {"op": "drop_model", "model_id": host_id(model.model_id)}
                self.submit(
                    host_of(self, model),
                    model.owner,
                    model.model_id,
                    body,
                    "unload_model",
                    lambda ok: ({}, None),
                )
        return [s.id for s in gone]

    def create_session(self, owner: str, tags: list[str]) -> ClientSession:
        self.expire_sessions()
        limit = self.quotas.of(owner).tinker_sessions
        with self._admit:
            have = self.records.live_sessions_of(owner)
            if limit is not None and have >= limit:
                raise TinkerError(403, f"quota tinker_sessions: owner '{owner}' may have at most {limit} "
                                  f"sessions; it has {have}", "quota.tinker_sessions")  # fmt: skip
            return self.records.new_session(owner, tags)

    def session(self, session_id: str, owner: str | None) -> ClientSession:
        found = self.records.session(session_id, owner)
        if found is None:
            raise not_found("session", session_id, "session_id")
        return found

    # ---- hosts ------------------------------------------------------------------------------------

    def host(self, base_model: str, field: str = "base_model") -> Host:
        host = self.hosts.get(base_model)
        if host is None:
            raise TinkerError(400, f"{field}: base model '{base_model}' is not served here; served: "
                              f"{sorted(self.hosts)} (tandem serve --base-model)", field)  # fmt: skip
        return host

    def capabilities(self) -> dict[str, Any]:
        return {"supported_models": [
            {"model_name": name, "trainable": True, "sampleable": True,
             "max_context_length": (host.info or {}).get("max_seq_len") or BUILTIN_CONTEXT}
            for name, host in self.hosts.items()
        ]}  # fmt: skip

    def submit(self, host: Host, owner: str, queue: str, body: dict[str, Any], kind: str,
               finish: Any, on_ok: Any = None, on_fail: Any = None) -> Future:  # fmt: skip
        future = self.futures.create(owner, kind)
        host.submit(Op(future, owner, queue, body, finish, on_ok, on_fail))
        return future

    # ---- training models --------------------------------------------------------------------------

    def model(self, model_id: str, owner: str | None) -> TrainingModel:
        """The caller's live training model; a run lost in a restart is a 400 naming its last state."""
        found = self.records.model(model_id, owner)
        if found is not None:
            return found
        rows, _ = self.store.list_jobs(metadata={"tinker_model_id": model_id}, owner=owner, limit=1)
        if rows:  # its error says why it is gone (a restart, an ended session) and its last saved state
            raise TinkerError(
                400, rows[0].error or lost_message(rows[0].id, Path(rows[0].workdir)), "model_id"
            )
        raise not_found("training model", model_id, "model_id")

    def create_model(self, owner: str, req: CreateModel, load: dict[str, Any] | None = None) -> Future:
        session = self.session(req.session_id, owner)
        host = self.host(req.base_model, "base_model")
        lora = req.lora_config or LoraConfig()
        rank = lora.rank
        if not 1 <= rank <= self.options.max_rank:
            raise TinkerError(400, f"lora_config.rank: {rank} is outside [1, {self.options.max_rank}] "
                              "(the bound of this service)", "lora_config.rank")  # fmt: skip
        optimizer = (req.optimizer_config or OptimizerConfig()).model_dump()
        if optimizer["type"] != "adamw":
            raise TinkerError(400, f"optimizer_config.type: only 'adamw' is served, not {optimizer['type']!r}",
                              "optimizer_config.type")  # fmt: skip
        model_id = f"{session.id}:train:{req.model_seq_id}"
        if model_id in self.records.models:
            raise TinkerError(400, f"model_seq_id: model {model_id} exists already", "model_seq_id")
        with self._admit:
            limit = self.quotas.of(owner).tinker_models
            have = self.records.live_models_of(owner)
            if limit is not None and have >= limit:
                raise TinkerError(403, f"quota tinker_models: owner '{owner}' may have at most {limit} live "
                                  f"training models; it has {have}", "quota.tinker_models")  # fmt: skip
            job = self.store.create_job(_row_spec(host.base_model, lora, model_id, req.session_id),
                                        self.home / "jobs", owner=owner, status=JobStatus.RUNNING)  # fmt: skip
            model = TrainingModel(model_id, job.id, owner, session.id, host.base_model, rank, Path(job.workdir),
                                  optimizer)  # fmt: skip
            self.records.add_model(model)  # now: a second create_model of this id is refused
        self.store.started(job.id, job.created_at)
        body = {"op": "create_model", "model_id": host_id(model_id), "rank": rank, "seed": lora.seed,
                "train_attn": lora.train_attn, "train_mlp": lora.train_mlp,
                "train_unembed": lora.train_unembed}  # fmt: skip

        def created(ok: dict[str, Any]) -> None:
            self.store.add_event(job.id, "created", f"LoRA rank {rank} on {host.base_model}: "
                                 f"{ok.get('trainable_params')} trainable parameters")  # fmt: skip

        def forget() -> None:  # a model the host refused goes with its row: a failed create stores nothing
            self.records.drop_model(model_id)
            if self.store.get_job(job.id) is not None:
                self.store.delete_job(job.id)

        if load is None:
            return self.submit(host, owner, model_id, body, "create_model",
                               lambda ok: ({"model_id": model_id, "type": "create_model"}, None), created, forget)  # fmt: skip
        # create_training_client_from_state: the same queue runs the load right after
        self.submit(host, owner, model_id, body, "create_model", lambda ok: ({}, None), created, forget)
        return self._load(model, load["path"], load["optimizer"], owner, forget)

    def info(self, model_id: str, owner: str | None) -> dict[str, Any]:
        model = self.model(model_id, owner)
        info = self.hosts[model.base_model].info or {}
        return {
            "type": "get_info",
            "model_id": model_id,
            "model_name": model.base_model,
            "is_lora": True,
            "lora_rank": model.rank,
            "optimizer_config": model.optimizer,
            # a local client loads the tokenizer from the host's model folder; see docs/tinker.md
            "model_data": {
                "arch": info.get("arch"),
                "model_name": model.base_model,
                "tokenizer_id": info.get("model_path"),
            },  # fmt: skip
        }

    def check_tokens(self, host: Host, tokens: list[int], field: str) -> None:
        vocab = (host.info or {}).get("vocab_size")
        for i, token in enumerate(tokens):
            if token < 0 or (vocab is not None and token >= vocab):
                raise TinkerError(400, f"{field}[{i}]: token id {token} is outside the vocabulary [0, {vocab})",
                                  field)  # fmt: skip

    def forward_backward(self, owner: str, req: dict[str, Any], forward_only: bool) -> Future:
        model = self.model(req["model_id"], owner)
        host = self.hosts[model.base_model]
        data = req["data"]
        for i, datum in enumerate(data):
            self.check_tokens(host, datum["tokens"], f"forward_backward_input.data[{i}].model_input")
        shapes = [
            (
                len(d["tokens"]),
                {name: (t["dtype"], list(t["shape"])) for name, t in d["loss_fn_inputs"].items()},
            )
            for d in data
        ]
        try:
            check_request(req["loss_fn"], shapes, req.get("loss_fn_config"))
        except LossInputError as err:
            raise TinkerError(400, str(err), f"forward_backward_input.{err.field}") from None
        for i, datum in enumerate(data):
            targets = datum["loss_fn_inputs"].get("target_tokens")
            if targets is not None:
                self.check_tokens(host, [int(t) for t in targets["data"]],
                                  f"forward_backward_input.data[{i}].loss_fn_inputs.target_tokens")  # fmt: skip
        body = {"op": "forward", "model_id": host_id(model.model_id), "data": data, "loss_fn": req["loss_fn"],
                "loss_fn_config": req.get("loss_fn_config"), "backward": not forward_only}  # fmt: skip

        def record(ok: dict[str, Any]) -> None:
            if not forward_only:
                self._metrics(model, {f"train/{k}": v for k, v in (ok.get("metrics") or {}).items()})

        def finish(ok: dict[str, Any]) -> tuple[None, bytes]:
            return None, write_forward_backward_output(ok["loss_fn_outputs"], ok.get("metrics") or {})

        return self.submit(host, owner, model.model_id, body, "forward_backward", finish, record)

    def _metrics(self, model: TrainingModel, values: dict[str, float]) -> None:
        with model.lock:
            model.step_metrics.update(values)
            merged = dict(model.step_metrics)
        self.store.add_metrics(model.job_id, model.step + 1, merged)

    def optim_step(self, owner: str, req: OptimStep) -> Future:
        model = self.model(req.model_id, owner)
        adam = req.adam_params.model_dump(exclude={"type"})  # bounds and finiteness: its type
        body = {"op": "optim_step", "model_id": host_id(model.model_id), "adam": adam}

        def stepped(ok: dict[str, Any]) -> None:
            self._metrics(model, {"train/learning_rate": adam["learning_rate"],
                                  **{f"train/{k}": v for k, v in (ok.get("metrics") or {}).items()}})  # fmt: skip
            with model.lock:
                model.step += 1
                model.step_metrics = {}
            self.store.bump_step(model.job_id, model.step)

        return self.submit(host_of(self, model), owner, model.model_id, body, "optim_step",
                           lambda ok: ({"metrics": ok.get("metrics") or {}, "type": "optim_step"}, None), stepped)  # fmt: skip

    # ---- state ------------------------------------------------------------------------------------

    def save_state(self, owner: str, req: SaveWeights) -> Future:
        model = self.model(req.model_id, owner)
        name = req.path or f"step-{model.step:06d}"
        if not NAME.match(name):
            raise TinkerError(400, f"path: checkpoint name {name!r} must match {NAME.pattern}", "path")
        folder = checkpoint_folder(model.workdir, "weights", name)
        if folder.exists() and not req.overwrite:
            raise TinkerError(400, f"path: checkpoint '{name}' exists (pass overwrite)", "path")
        tinker_path = f"tinker://{model.job_id}/weights/{name}"
        body = {
            "op": "save_state",
            "model_id": host_id(model.model_id),
            "path": str(folder),
            "optimizer": True,
        }

        def saved(ok: dict[str, Any]) -> None:
            folder.mkdir(parents=True, exist_ok=True)
            (folder / ".complete").write_text(tinker_path + "\n")
            self.store.add_event(model.job_id, "checkpoint", f"saved state {tinker_path}")

        return self.submit(host_of(self, model), owner, model.model_id, body, "save_weights",
                           lambda ok: ({"path": tinker_path, "type": "save_weights"}, None), saved)  # fmt: skip

    def resolve_state(self, path: str, owner: str | None, field: str = "path") -> tuple[Any, Path]:
        """(run row, folder) of a caller's `tinker://RUN/weights/NAME`; 404 for another owner's."""
        parsed = parse_tinker_path(path)
        if parsed is None or parsed[1] != "weights":
            raise TinkerError(400, f"{field}: {path!r} is not a training checkpoint path "
                              "(tinker://RUN/weights/NAME)", field)  # fmt: skip
        job = self.store.get_job(parsed[0])
        if job is None or job.method != METHOD or (owner is not None and job.owner != owner):
            raise not_found("checkpoint", path, field)
        folder = checkpoint_folder(Path(job.workdir), "weights", parsed[2])
        if not (folder / ".complete").exists():
            raise not_found("checkpoint", path, field)
        return job, folder

    def load_state(self, owner: str, req: LoadWeights) -> Future:
        if req.model_id:
            return self._load(self.model(req.model_id, owner), req.path, req.optimizer, owner)
        job, _ = self.resolve_state(req.path, owner)  # a new training client from a checkpoint
        create = CreateModel(session_id=req.session_id or "", model_seq_id=req.model_seq_id,
                             base_model=req.base_model or job.spec["model"]["builtin"],
                             lora_config=LoraConfig(rank=job.spec["model"]["lora"]["rank"]),
                             optimizer_config=req.optimizer_config)  # fmt: skip
        return self.create_model(owner, create, load={"path": req.path, "optimizer": req.optimizer})

    def _load(
        self, model: TrainingModel, path: str, optimizer: bool, owner: str, on_fail: Any = None
    ) -> Future:
        job, folder = self.resolve_state(path, owner)
        if (
            job.spec["model"]["builtin"] != model.base_model
            or job.spec["model"]["lora"]["rank"] != model.rank
        ):
            raise TinkerError(400, f"path: {path} is a rank-{job.spec['model']['lora']['rank']} adapter of "
                              f"{job.spec['model']['builtin']}; this model is rank {model.rank} on "
                              f"{model.base_model}", "path")  # fmt: skip
        body = {
            "op": "load_state",
            "model_id": host_id(model.model_id),
            "path": str(folder),
            "optimizer": optimizer,
        }

        def loaded(ok: dict[str, Any]) -> None:
            self.store.add_event(model.job_id, "resumed", f"loaded {path} ({'with' if optimizer else 'without'} "
                                 "optimizer state)")  # fmt: skip

        return self.submit(host_of(self, model), owner, model.model_id, body, "load_weights",
                           lambda ok: ({"path": path, "model_id": model.model_id, "type": "load_weights"}, None),
                           loaded, on_fail)  # fmt: skip

    def unload(self, owner: str, model_id: str) -> Future:
        model = self.model(model_id, owner)

        def dropped(ok: dict[str, Any]) -> None:
            self.records.drop_model(model.model_id)
            self.store.transition(model.job_id, (JobStatus.RUNNING,), JobStatus.SUCCEEDED)

        return self.submit(host_of(self, model), owner, model.model_id, {"op": "drop_model", "model_id": host_id(model_id)},
                           "unload_model", lambda ok: ({"model_id": model_id, "type": "unload_model"}, None),
                           dropped)  # fmt: skip

    def cancel_run(self, job: Any) -> None:
        """`tandem cancel` of a training run: its model leaves the host (its checkpoints stay)."""
        model = self.records.model_of_job(job.id)
        if model is not None:
            self._drop(model)

    def _drop(self, model: TrainingModel) -> None:
        """Forget a model here and drop it from its host (queued after its pending ops)."""
        self.records.drop_model(model.model_id)
        body = {"op": "drop_model", "model_id": host_id(model.model_id)}
        self.submit(
            host_of(self, model), model.owner, model.model_id, body, "unload_model", lambda ok: ({}, None)
        )


def host_id(model_id: str) -> str:
    """The id a host knows a model by: the SDK's ids carry ':' (`SESSION:train:N`), the host's may not."""
    return re.sub(r"[^A-Za-z0-9._-]", "-", model_id)


def host_of(service: TinkerService, model: TrainingModel) -> Host:
    return service.hosts[model.base_model]


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]", "_", name)[-100:]


def _row_spec(base: str, lora: LoraConfig, model_id: str, session_id: str) -> dict[str, Any]:
    """The job-store row of a training model: enough for `tandem list`, the dashboard and the views."""
    targets = [t for t, on in (("attn", lora.train_attn), ("mlp", lora.train_mlp),
                               ("unembed", lora.train_unembed)) if on]  # fmt: skip
    rank = lora.rank
    return {
        "method": METHOD,
        "model": {"builtin": base, "lora": {"rank": rank, "alpha": rank, "target_modules": targets}},
        "trainer": {"total_steps": 0},
        "name": model_id,
        "metadata": {"tinker_model_id": model_id, "tinker_session_id": session_id},
        "tags": ["tinker"],
    }
