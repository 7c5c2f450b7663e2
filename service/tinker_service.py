"""The Tinker API's training side: a request is checked before anything is queued (a bad one is a 4xx
naming the field), then becomes one operation of its base's session host, answered by a future. A
training model is a run of the scheduler's Tinker workload: its ops wait until the scheduler launches it."""

from __future__ import annotations

import json
import re
import secrets
import shutil
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from schema.tinker_losses import LossInputError, check_request
from service import tinker_checkpoints as saved
from service import tinker_requests as bodies
from service.job_state import JobStatus
from service.service import Service
from service.tinker_hosts import Finish, Host, HostOptions, Op
from service.tinker_requests import TinkerError
from service.tinker_sessions import (
    ClientSession,
    Future,
    FutureTable,
    Records,
    Sampler,
    TrainingModel,
    use_recorded,
)
from service.tinker_wire import write_forward_backward_output
from workers.session_host import SessionWorker

BUILTIN_CONTEXT = 512
SESSION_TTL_S = 600.0  # a session without a heartbeat for this long ends


class TinkerService:
    """The Tinker API's requests, and the server of the scheduler's Tinker workload (`launch`, `stop`)."""

    def __init__(self, service: Service, base_models: list[str], options: HostOptions | None = None) -> None:
        self.service, self.store, self.quotas = service, service.store, service.quotas
        self.scheduler, self.home = service.scheduler, service.home
        self.scheduler.hosted["tinker"].server = self
        self.options = options or HostOptions()
        self.futures = FutureTable()
        self.records = Records()
        self.hosts = {
            name: Host(name, self.home / "tinker" / "hosts" / _safe(name), self.futures, self.options,
                       on_lost=self._host_lost, accounts=self.scheduler)
            for name in base_models
        }  # fmt: skip
        # samplers live in memory: the last run's unnamed snapshots (SessionWorker.save_for_sampler's) are nobody's
        for host in self.hosts.values():
            shutil.rmtree(host.workdir / "samplers", ignore_errors=True)
        # a built-in base is also served under its folder (`tandem models build NAME`), a name that
        # Hugging Face loaders (the cookbook's get_tokenizer) read offline
        self.aliases = {str(root / "models" / name): name for name in base_models if "/" not in name
                        for root in {self.home, self.home.resolve()}}  # fmt: skip
        self._admit = threading.Lock()
        self._launches: dict[str, list[Op]] = {}  # model id -> its ops held until the scheduler launches it
        self._held = threading.Lock()
        self.session_ttl_s = SESSION_TTL_S
        self.url_secret = secrets.token_bytes(32)  # signs external weights' download URLs
        self._reaped = 0.0

    def shutdown(self) -> None:
        for host in self.hosts.values():
            host.stop()

    # ---- sessions ---------------------------------------------------------------------------------

    def expire_sessions(self) -> None:
        """Silent sessions end (the SDK beats every 10 s): their models leave the host and their runs
        pause, naming the last saved state. Expired checkpoints are swept here too."""
        now = time.time()
        if now - self._reaped > saved.REAP_EVERY_S:  # listing a run's checkpoints removes its expired ones
            self._reaped = now
            for job in self.store.tinker_runs(None):
                saved.list_checkpoints(job.id, job.workdir)
        for session in [
            s for s in self.records.sessions.of(None) if now - s.last_heartbeat > self.session_ttl_s
        ]:
            self._end_session(
                session.id, f"session {session.id} ended (no heartbeat for {self.session_ttl_s:g} s)"
            )

    def finish_session(self, owner: str | None, session_id: str) -> dict[str, Any]:
        """The SDK's close(): the session ends now, as a silent one would later (and leaves its quota)."""
        self._end_session(
            self.records.sessions.find(session_id, owner).id, f"session {session_id} was finished"
        )
        return {}

    def _end_session(self, session_id: str, cause: str) -> None:
        """Its samplers and their snapshots go; its models leave the host and their runs pause."""
        self.drop_snapshots(self.records.end_session(session_id))
        self._pause([m for m in self.records.models.of(None) if m.session_id == session_id], cause, True)

    def drop_snapshots(self, samplers: list[Sampler]) -> None:
        """Dropped samplers' unnamed snapshots leave their host's disk, after the samples queued on them
        (a named one is a checkpoint and stays)."""
        for sampler in [s for s in samplers if s.path is not None and s.tinker_path is None]:
            self.submit(self.hosts[sampler.base_model], sampler.owner, sampler.id, SessionWorker.drop_sampler,
                        {"path": sampler.path}, {}, bounded=False)  # fmt: skip

    def _host_lost(self, host: Host) -> None:
        """A host's process died with its adapters: their runs pause, each naming its last saved state."""
        models = [m for m in self.records.models.of(None) if m.base_model == host.base_model]
        self._pause(models, f"its session host ({host.base_model}) died", False)

    def _pause(self, models: list[TrainingModel], cause: str, drop: bool) -> None:
        """The models are forgotten (`drop`: and leave their live host); their runs pause, naming why."""
        for model in models:
            why = saved.lost_message(model.job_id, model.workdir, cause)
            self._forget_live(model, why, drop)
            self.scheduler.end(model.job_id, JobStatus.PAUSED, why)

    def _forget_live(self, model: TrainingModel, why: str, drop: bool) -> None:
        """The model is forgotten. A run the scheduler never launched fails its held ops, saying why;
        a launched one's adapter leaves its host after its pending ops (`drop`)."""
        self.records.models.pop(model.model_id, None)
        with self._held:
            held = self._launches.pop(model.model_id, None)
        for op in held or []:
            self.futures.fail(op.future, why, "user")
        if held is None and drop:
            self.on_model(model, SessionWorker.drop_adapter, {}, {}, bounded=False)

    def _quota(self, owner: str, name: str, have: list, what: str) -> None:
        limit = getattr(self.quotas.of(owner), name)
        if limit is not None and len(have) >= limit:
            raise TinkerError(403, f"quota {name}: owner '{owner}' may have at most {limit} {what}; it has "
                              f"{len(have)}", f"quota.{name}")  # fmt: skip

    def create_session(self, owner: str, req: bodies.CreateSession) -> dict[str, Any]:
        self.expire_sessions()
        with self._admit:
            self._quota(owner, "tinker_sessions", self.records.sessions.of(owner), "sessions")
            now, session_id = time.time(), f"sess-{uuid.uuid4().hex[:12]}"
            self.records.sessions[session_id] = ClientSession(
                session_id, owner, now, now, req.tags[: bodies.MAX_TAGS]
            )
        return {"type": "create_session", "session_id": session_id}

    def heartbeat(self, owner: str | None, req: bodies.SessionRef) -> dict[str, Any]:
        self.expire_sessions()
        self.records.sessions.find(req.session_id, owner).last_heartbeat = time.time()
        return {"type": "session_heartbeat"}

    # ---- hosts ------------------------------------------------------------------------------------

    def host(self, base_model: str, field: str = "base_model") -> Host:
        host = self.hosts.get(self.aliases.get(base_model, base_model))
        if host is None:
            raise TinkerError(400, f"{field}: base model '{base_model}' is not served here; served: "
                              f"{sorted(self.hosts)} (tandem serve --base-model)", field)  # fmt: skip
        return host

    def capabilities(self) -> dict[str, Any]:
        built = [alias for alias in self.aliases if Path(alias, "config.json").is_file()]
        return {"supported_models": [
            {"model_name": name, "trainable": True, "sampleable": True,
             "max_context_length": (self.host(name).info or {}).get("max_seq_len") or BUILTIN_CONTEXT}
            for name in [*self.hosts, *built]
        ]}  # fmt: skip

    def submit(self, to: Host | list[Op], owner: str, queue: str, operation: Any, kwargs: dict[str, Any],
               finish: Finish, on_fail: Any = None, bounded: bool = True) -> Future:  # fmt: skip
        """Queue one op on a host (or on a held list); the caller's future for it. A `bounded` one is a
        429 when its owner has too many queued (the service's own, and a model's creation, are not)."""
        limit = self.options.max_pending if bounded else None
        future = self.futures.create(owner, operation.__name__, limit)
        op = Op(future, owner, queue, operation, kwargs, finish, on_fail)
        if isinstance(to, list):
            to.append(op)
        else:
            to.submit(op)
        return op.future

    def on_model(self, model: TrainingModel, operation: Any, kwargs: dict[str, Any], finish: Finish,
                 on_fail: Any = None, bounded: bool = True) -> Future:  # fmt: skip
        """Queue `operation` on the model's adapter after its earlier ops; a run the scheduler has not
        launched yet keeps them until it does (`launch`)."""
        kwargs = {"adapter": _safe(model.model_id), **kwargs}
        with self._held:
            held = self._launches.get(model.model_id)
            to = held if held is not None else self.hosts[model.base_model]
            return self.submit(to, model.owner, model.model_id, operation, kwargs, finish, on_fail, bounded)

    # ---- training models --------------------------------------------------------------------------

    def model(self, model_id: str, owner: str | None) -> TrainingModel:
        """The caller's live training model; a run lost in a restart is a 400 naming its last state."""
        if self.records.models.seen(model_id, owner) is None:
            rows, _ = self.store.list_jobs(metadata={"tinker_model_id": model_id}, owner=owner, limit=1)
            if rows:  # its error says why it is gone (a restart, an ended session) and its last saved state
                raise TinkerError(
                    400, rows[0].error or saved.lost_message(rows[0].id, Path(rows[0].workdir)), "model_id"
                )
        return self.records.models.find(model_id, owner)

    def create_model(self, owner: str, req: bodies.CreateModel) -> Future:
        session = self.records.sessions.find(req.session_id, owner)
        host = self.host(req.base_model, "base_model")
        lora = req.lora_config or bodies.LoraConfig()
        rank = lora.rank
        if not 1 <= rank <= self.options.max_rank:
            raise TinkerError(400, f"lora_config.rank: {rank} is outside [1, {self.options.max_rank}] "
                              "(the bound of this service)", "lora_config.rank")  # fmt: skip
        optimizer = (req.optimizer_config or bodies.OptimizerConfig()).model_dump()
        model_id = f"{session.id}:train:{req.model_seq_id}"
        trains = lora.model_dump(include={"train_attn", "train_mlp", "train_unembed"})
        targets = [name.removeprefix("train_") for name, on in trains.items() if on]
        with self._admit:
            if model_id in self.records.models:
                raise TinkerError(400, f"model_seq_id: model {model_id} exists already", "model_seq_id")
            self._quota(owner, "tinker_models", self.records.models.of(owner), "live training models")
            with self._held:  # before its row: the scheduler may launch the run as soon as the row exists
                self._launches[model_id] = []  # its ops wait for the scheduler to launch the run
            try:
                with self.service.admitting():  # the owner's queued and stored quotas, as a job's submission
                    self.service.check_quota(owner)
                    job = self.store.create_tinker_run(owner, model_id, session.id, host.base_model, rank,
                                                       targets, self.home / "jobs")  # fmt: skip
            except BaseException:
                with self._held:
                    self._launches.pop(model_id, None)
                raise
            model = TrainingModel(model_id, job.id, owner, session.id, host.base_model, rank, Path(job.workdir),
                                  optimizer)  # fmt: skip
            self.records.models[model_id] = model  # now: a second create_model of this id is refused
        model.workdir.mkdir(parents=True, exist_ok=True)
        (model.workdir / "user_metadata.json").write_text(json.dumps(req.user_metadata or {}))

        def created(ok: dict[str, Any]) -> dict[str, Any]:
            self.store.add_event(job.id, "created", f"LoRA rank {rank} on {host.base_model}: "
                                 f"{ok.get('trainable_params')} trainable parameters")  # fmt: skip
            return {"model_id": model_id, "type": "create_model"}

        future = self.on_model(model, SessionWorker.create_adapter, {"rank": rank, "seed": lora.seed, **trains},
                               created, lambda: self._forget(model), bounded=False)  # fmt: skip
        self.scheduler.admit(job.id)  # else it waits in the queue for its owner's quota or for room
        return future

    def _forget(self, model: TrainingModel) -> None:
        """A model the host refused goes with its row: a failed create stores nothing."""
        self.records.models.pop(model.model_id, None)
        self.scheduler.forget(model.job_id)

    def launch(self, record: Any) -> None:
        """The scheduler admitted a run: its held ops (its creation, a load) go to its host."""
        host = self.hosts[record.spec["model"]["builtin"]]
        with self._held:
            for op in self._launches.pop(record.metadata["tinker_model_id"]):
                host.submit(op)

    def stop(self, record_id: str) -> None:
        """A run cancelled through Tandem's API: its model leaves its host (its checkpoints stay)."""
        model = self.records.model_of_job(record_id)
        if model is not None:
            self._forget_live(model, f"training run {record_id} was cancelled through Tandem's API", True)

    def info(self, owner: str | None, req: bodies.ModelRef) -> dict[str, Any]:
        model = self.model(req.model_id, owner)
        info = self.hosts[model.base_model].info or {}
        return {
            "type": "get_info",
            "model_id": model.model_id,
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

    def forward_backward(self, owner: str, req: dict[str, Any]) -> Future:
        """A forward (`forward_only`: no gradients), its body as `ForwardBackward.plain` makes it."""
        model, forward_only = self.model(req["model_id"], owner), req["forward_only"]
        host = self.hosts[model.base_model]
        data = req["data"]
        for i, datum in enumerate(data):
            field = f"forward_backward_input.data[{i}].model_input"
            if not datum["tokens"]:  # the host would fail it as its own error, naming no field
                raise TinkerError(400, f"{field}: must hold at least one token", field)
            self.check_tokens(host, datum["tokens"], field)
        shapes = [(len(d["tokens"]), {name: (t["dtype"], t["shape"]) for name, t in d["loss_fn_inputs"].items()})
                  for d in data]  # fmt: skip
        try:
            check_request(req["loss_fn"], shapes, req.get("loss_fn_config"))
        except LossInputError as err:
            raise TinkerError(400, str(err), f"forward_backward_input.{err.field}") from None
        for i, datum in enumerate(data):
            targets = datum["loss_fn_inputs"].get("target_tokens")
            if targets is not None:
                self.check_tokens(host, [int(t) for t in targets["data"]],
                                  f"forward_backward_input.data[{i}].loss_fn_inputs.target_tokens")  # fmt: skip
        if req["loss_fn"] == "stable_reinforce":  # the loss that trains on the sampler's recorded log-probs
            use_recorded(self.records, owner, data)
        for datum in data:
            datum.pop("spans", None)

        def done(ok: dict[str, Any]) -> bytes:
            if not forward_only:
                self._metrics(model, ok.get("metrics") or {})
            return write_forward_backward_output(ok["loss_fn_outputs"], ok.get("metrics") or {})

        kwargs = {"data": data, "loss_fn": req["loss_fn"], "loss_fn_config": req.get("loss_fn_config"),
                  "backward": not forward_only}  # fmt: skip
        return self.on_model(model, SessionWorker.forward_backward_calls, kwargs, done)

    def _metrics(self, model: TrainingModel, values: dict[str, float]) -> None:
        with model.lock:
            model.step_metrics.update({f"train/{k}": v for k, v in values.items()})
            merged = dict(model.step_metrics)
        self.store.add_metrics(model.job_id, model.step + 1, merged)

    def optim_step(self, owner: str, req: bodies.OptimStep) -> Future:
        model = self.model(req.model_id, owner)
        adam = req.adam_params.model_dump(exclude={"type"})  # bounds and finiteness: its type

        def stepped(grad_norm: float) -> dict[str, Any]:
            metrics = {"grad_norm": grad_norm, "learning_rate": adam["learning_rate"]}
            self._metrics(model, metrics)
            with model.lock:
                model.step += 1
                model.step_metrics = {}
            self.store.bump_step(model.job_id, model.step)
            return {"metrics": metrics, "type": "optim_step"}

        return self.on_model(model, SessionWorker.optim_step, {"params": adam}, stepped)

    # ---- state ------------------------------------------------------------------------------------

    def load_state(self, owner: str, req: bodies.LoadWeights) -> Future:
        if req.model_id:
            model = self.model(req.model_id, owner)
            job, folder = saved.resolve_state(self.store, req.path, owner)
            return self._load(model, req.path, job.spec["model"], folder, req.optimizer)
        if req.session_id is None:
            raise TinkerError(400, "session_id: required when model_id is not given", "session_id")
        # a new model from the state: a create_model whose queue runs the load right after
        self.records.sessions.find(req.session_id, owner)
        job, folder = saved.resolve_state(self.store, req.path, owner)
        spec = job.spec["model"]
        host = self.host(req.base_model or spec["builtin"], "base_model")
        _state_fits(req.path, spec, host.base_model, spec["lora"]["rank"])
        lora = bodies.LoraConfig(rank=spec["lora"]["rank"])
        self.create_model(owner, req.model_copy(update={"base_model": host.base_model, "lora_config": lora}))
        model = self.records.models[f"{req.session_id}:train:{req.model_seq_id}"]
        return self._load(model, req.path, spec, folder, req.optimizer, lambda: self._forget(model))

    def _load(self, model: TrainingModel, path: str, spec: dict[str, Any], folder: Path, optimizer: bool,
              on_fail: Any = None) -> Future:  # fmt: skip
        _state_fits(path, spec, model.base_model, model.rank)

        def loaded(ok: Any) -> dict[str, Any]:
            self.store.add_event(model.job_id, "resumed", f"loaded {path} ({'with' if optimizer else 'without'} "
                                 "optimizer state)")  # fmt: skip
            return {"path": path, "model_id": model.model_id, "type": "load_weights"}

        kwargs = {"path": str(folder), "optimizer": optimizer}
        # a new model's load (on_fail) goes with its creation, which the models quota bounds
        return self.on_model(model, SessionWorker.load_state, kwargs, loaded, on_fail, on_fail is None)

    def unload(self, owner: str, req: bodies.ModelRef) -> Future:
        model = self.model(req.model_id, owner)

        def dropped(ok: Any) -> dict[str, Any]:
            self.records.models.pop(model.model_id, None)
            self.scheduler.end(model.job_id, JobStatus.SUCCEEDED)
            return {"model_id": req.model_id, "type": "unload_model"}

        return self.on_model(model, SessionWorker.drop_adapter, {}, dropped)


def _state_fits(path: str, spec: dict[str, Any], base_model: str, rank: int) -> None:
    if (spec["builtin"], spec["lora"]["rank"]) != (base_model, rank):
        raise TinkerError(400, f"path: {path} is a rank-{spec['lora']['rank']} adapter of {spec['builtin']}; "
                          f"this model is rank {rank} on {base_model}", "path")  # fmt: skip


def _safe(name: str) -> str:
    """A name as a folder's, and a model's id as its host knows it (the SDK's carry ':')."""
    return re.sub(r"[^A-Za-z0-9._-]", "_", name)[-100:]
