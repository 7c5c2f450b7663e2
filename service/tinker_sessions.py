"""The Tinker API's in-memory records: client sessions, training models, samplers, recorded samples.
A training model is also a `tinker_runs` row (its id names its checkpoints); its adapter lives in the
host, so a restart pauses the run (`lost_message`). A lookup answers None for another owner's id (None:
the admin sees all), so that it is a 404 like an unknown one."""

from __future__ import annotations

import threading
import time
import uuid
from array import array
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from service.tinker_checkpoints import list_checkpoints
from service.tinker_requests import TinkerError

# Samples kept for `record_stability_info` (prompt and sampled tokens in all), oldest dropped first.
MAX_RECORDED_TOKENS = 4_000_000


@dataclass
class ClientSession:
    id: str
    owner: str
    created: float
    last_heartbeat: float
    tags: list[str] = field(default_factory=list)


@dataclass
class TrainingModel:
    model_id: str
    job_id: str
    owner: str
    session_id: str
    base_model: str
    rank: int
    workdir: Path
    optimizer: dict[str, Any]
    step: int = 0  # optimizer steps taken
    step_metrics: dict[str, float] = field(default_factory=dict)  # this step's, merged for the store
    lock: threading.Lock = field(default_factory=threading.Lock)


@dataclass
class Recorded:
    """A sequence sampled with `record_stability_info`: what a training datum's spans may name."""

    owner: str
    prompt: array
    tokens: array
    logprobs: array


@dataclass
class Sampler:
    id: str
    owner: str
    base_model: str
    path: str | None  # the snapshot folder on the host's disk; None = the base model
    tinker_path: str | None
    job_id: str | None  # the training run it came from: its samples go to that row


def _seen(found: Any, owner: str | None) -> Any:
    return found if found is not None and owner in (None, found.owner) else None


class Records:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.sessions: dict[str, ClientSession] = {}
        self.models: dict[str, TrainingModel] = {}
        self.samplers: dict[str, Sampler] = {}
        self.sequences: OrderedDict[str, Recorded] = OrderedDict()
        self._recorded_tokens = 0

    def new_session(self, owner: str, tags: list[str]) -> ClientSession:
        now = time.time()
        session = ClientSession(f"sess-{uuid.uuid4().hex[:12]}", owner, now, now, tags)
        with self._lock:
            self.sessions[session.id] = session
        return session

    def session(self, session_id: str, owner: str | None) -> ClientSession | None:
        return _seen(self.sessions.get(session_id), owner)

    def model(self, model_id: str, owner: str | None) -> TrainingModel | None:
        return _seen(self.models.get(model_id), owner)

    def model_of_job(self, job_id: str) -> TrainingModel | None:
        return next((m for m in list(self.models.values()) if m.job_id == job_id), None)

    def add_model(self, model: TrainingModel) -> None:
        with self._lock:
            self.models[model.model_id] = model

    def drop_model(self, model_id: str) -> None:
        with self._lock:
            self.models.pop(model_id, None)

    def sampler(self, sampler_id: str, owner: str | None) -> Sampler | None:
        return _seen(self.samplers.get(sampler_id), owner)

    def add_sampler(self, sampler: Sampler) -> None:
        with self._lock:
            self.samplers[sampler.id] = sampler

    def record(self, owner: str, ids: list[str], prompt: list[int], sequences: list[dict[str, Any]]) -> None:
        shared = array("i", prompt)
        with self._lock:
            for sequence_id, seq in zip(ids, sequences, strict=False):
                logprobs = array("f", [float("nan") if v is None else v for v in seq.get("logprobs") or []])
                self.sequences[sequence_id] = Recorded(owner, shared, array("i", seq["tokens"]), logprobs)
                self._recorded_tokens += len(prompt) + len(seq["tokens"])
            while self._recorded_tokens > MAX_RECORDED_TOKENS and self.sequences:
                _, old = self.sequences.popitem(last=False)
                self._recorded_tokens -= len(old.prompt) + len(old.tokens)

    def end_session(self, session_id: str) -> None:
        """The session's recorded samples go with it (their ids start with its id)."""
        with self._lock:
            self.sessions.pop(session_id, None)
            for key in [k for k in self.sequences if k.startswith(session_id + ":")]:
                old = self.sequences.pop(key)
                self._recorded_tokens -= len(old.prompt) + len(old.tokens)

    def live_models_of(self, owner: str) -> int:
        return sum(1 for m in list(self.models.values()) if m.owner == owner)

    def live_sessions_of(self, owner: str) -> int:
        return sum(1 for s in list(self.sessions.values()) if s.owner == owner)


def last_saved_state(job_id: str, workdir: Path) -> str | None:
    """The tinker path of the run's newest training checkpoint (save_state), if any."""
    saved = [c for c in list_checkpoints(job_id, workdir) if c["checkpoint_type"] == "training"]
    return saved[-1]["tinker_path"] if saved else None


def lost_message(job_id: str, workdir: Path, cause: str = "the service restarted") -> str:
    last = last_saved_state(job_id, workdir)
    if last is None:
        return (f"training run {job_id} was lost when {cause}, and it saved no state "
                "(save_state): create a new training client")  # fmt: skip
    return (f"training run {job_id} was lost when {cause}; its last saved state is {last}: "
            f"continue with service_client.create_training_client_from_state_with_optimizer('{last}')")  # fmt: skip


def use_recorded(records: Records, owner: str, data: list[dict[str, Any]]) -> None:
    """Check a datum's provenance spans against the recorded samples they name, and train on the
    sampler's recorded log-probs where its targets are sampled tokens."""
    for i, datum in enumerate(data):
        spans = datum.pop("spans", None) or {}
        inputs = datum["loss_fn_inputs"]
        targets = [int(t) for t in (inputs.get("target_tokens") or {}).get("data", [])]
        for name, tokens in (("model_input_spans", datum["tokens"]), ("loss_fn_input_spans", targets)):
            where, pos = f"forward_backward_input.data[{i}].{name}", 0
            for j, span in enumerate(spans.get(name) or []):
                at, end = f"{where}[{j}]", span["offset"] + span["length"]
                found = records.sequences.get(span["sequence_id"])
                if found is None or found.owner != owner:
                    raise TinkerError(400, f"{at}.sequence_id: no recorded sample '{span['sequence_id']}' (sample "
                                      "with record_stability_info=True; a session's records end with it)",
                                      f"{at}.sequence_id")  # fmt: skip
                source = found.tokens if span["kind"] == "sampled" else found.prompt
                if (
                    end > len(source)
                    or list(source[span["offset"] : end]) != tokens[pos : pos + span["length"]]
                ):
                    raise TinkerError(400, f"{at}: positions [{pos}, {pos + span['length']}) are not tokens "
                                      f"[{span['offset']}, {end}) of the {span['kind']} sample", at)  # fmt: skip
                if span["kind"] == "sampled" and name == "loss_fn_input_spans" and "logprobs" in inputs:
                    inputs["logprobs"]["data"][pos : pos + span["length"]] = found.logprobs[
                        span["offset"] : end
                    ]
                pos += span["length"]
            if spans.get(name) and pos != len(tokens):
                raise TinkerError(400, f"{where}: the spans cover {pos} positions of {len(tokens)}", where)
