"""The Tinker API's in-memory records: client sessions, training models, samplers, recorded samples and
futures. A training model is also a `tinker_runs` row (its id names its checkpoints); its adapter lives
in the host, so a restart pauses the run. A future is a request id the SDK polls (`retrieve_future`):
its owner's JSON answer, protobuf bytes or a failure in the SDK's `{"error", "category"}` shape,
resolved by dispatcher threads and read by the event loop."""

from __future__ import annotations

import threading
import time
import uuid
from array import array
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generic, TypeVar

from service.tinker_requests import TinkerError, not_found

# Samples kept per owner for `record_stability_info` (prompt and sampled tokens in all), the owner's oldest
# dropped first: one owner's samples never push out another's.
MAX_RECORDED_TOKENS = 4_000_000
MAX_SAMPLERS = 1024  # per owner, the oldest dropped first (an RL loop makes one a step and uses the newest)
KEEP_S = 3600.0  # how long a finished future stays readable
READ_KEEP_S = 60.0  # and once its answer was read: long enough for the SDK to poll again after a lost reply
MAX_UNREAD = 1024  # finished answers kept unread per owner, oldest dropped first (the SDK polls each at once)
SWEEP_EVERY_S = 10.0
V = TypeVar("V")


class Owned(dict[str, V], Generic[V]):
    """Records by id, each with an `owner`; `what` they are, and the field that names one."""

    def __init__(self, what: str, field: str) -> None:
        super().__init__()
        self.what, self.field = what, field

    def find(self, key: str, owner: str | None, field: str | None = None) -> V:
        """The caller's record; another owner's is a 404 like an unknown one."""
        found = self.seen(key, owner)
        if found is None:
            raise not_found(self.what, key, field or self.field)
        return found

    def seen(self, key: str, owner: str | None) -> V | None:
        """None for another owner's id (None: the admin sees all), so that it is a 404 like an unknown one."""
        found = self.get(key)
        return found if found is not None and owner in (None, found.owner) else None  # type: ignore[attr-defined]

    def of(self, owner: str | None) -> list[V]:
        return [v for v in list(self.values()) if owner in (None, v.owner)]  # type: ignore[attr-defined]


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


@dataclass
class Future:
    id: str
    owner: str
    kind: str
    created: float = field(default_factory=time.time)
    done_at: float | None = None
    answer: dict[str, Any] | bytes | None = None
    read_at: float | None = None  # when its answer was first read
    cancelled: bool = False
    queued: bool = False  # its op holds its request's data in a queue: it counts against its owner

    @property
    def done(self) -> bool:
        return self.done_at is not None


class FutureTable(Owned[Future]):
    def __init__(self) -> None:
        super().__init__("future", "request_id")
        self._lock = threading.Lock()
        self._swept = 0.0
        self._queued: dict[str, int] = {}  # owner -> their futures whose op is still queued or running

    def create(self, owner: str, kind: str, limit: int | None = None) -> Future:
        """A future for an op about to be queued; a 429 (the SDK backs off and retries) when the owner
        has `limit` queued already, each holding its request's data."""
        future = Future(f"req-{uuid.uuid4().hex[:16]}", owner, kind, queued=True)
        with self._lock:
            have = self._queued.get(owner, 0)
            if limit is not None and have >= limit:
                field = "tinker_max_pending_requests"
                raise TinkerError(429, f"{field}: owner '{owner}' has {have} requests queued or running, the "
                                  f"most this service holds for one owner ({limit}); retry as they are answered",
                                  field)  # fmt: skip
            self._queued[owner] = have + 1
            now = time.time()
            if now - self._swept >= SWEEP_EVERY_S:  # a sweep visits every future: not on every request
                self._swept = now
                for key in [k for k, f in self.items() if _expired(f, now)] + self._unread_beyond_bound():
                    self.pop(key, None)
            self[future.id] = future
        return future

    def _unread_beyond_bound(self) -> list[str]:
        """Each owner's finished, unread futures beyond MAX_UNREAD, oldest first."""
        unread: dict[str, list[Future]] = {}
        for future in self.values():
            if future.done and future.read_at is None:
                unread.setdefault(future.owner, []).append(future)
        return [f.id for kept in unread.values() for f in sorted(kept, key=lambda f: f.done_at)[:-MAX_UNREAD]]

    def finish(self, future: Future, answer: dict[str, Any] | bytes) -> None:
        with self._lock:
            self._release(future)
            if not future.done:  # cancelled first: the late result is dropped
                future.answer, future.done_at = answer, time.time()

    def read(self, future: Future) -> None:
        """Its answer was read: the answer (a forward's may be megabytes) need not stay for an hour."""
        future.read_at = future.read_at or time.time()

    def release(self, future: Future) -> None:
        """Its op left its queue unanswered (cancelled while queued)."""
        with self._lock:
            self._release(future)

    def _release(self, future: Future) -> None:
        if future.queued:
            future.queued = False
            self._queued[future.owner] -= 1
            if not self._queued[future.owner]:
                del self._queued[future.owner]

    def fail(self, future: Future, message: str, category: str = "server") -> None:
        self.finish(future, {"error": message, "category": category})

    def cancel(self, future: Future) -> bool:
        """Marks a pending future cancelled (its queued work is skipped, and counts until then); False if
        it had finished."""
        with self._lock:
            if future.done:
                return False
            future.cancelled, future.done_at = True, time.time()
            future.answer = {"error": "cancelled by the client", "category": "user"}
            return True


def _expired(future: Future, now: float) -> bool:
    if future.read_at is not None and future.read_at < now - READ_KEEP_S:
        return True
    return future.done_at is not None and future.done_at < now - KEEP_S


class Records:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.sessions: Owned[ClientSession] = Owned("session", "session_id")
        self.models: Owned[TrainingModel] = Owned("training model", "model_id")
        self.samplers: Owned[Sampler] = Owned("sampler", "sampling_session_id")
        self.sequences: OrderedDict[str, Recorded] = OrderedDict()
        self._recorded_tokens: dict[str, int] = {}  # owner -> tokens of their recorded samples

    def add_sampler(self, sampler: Sampler) -> list[Sampler]:
        """The owner's samplers beyond MAX_SAMPLERS, oldest first, are dropped and returned."""
        with self._lock:
            self.samplers[sampler.id] = sampler
            dropped = self.samplers.of(sampler.owner)[:-MAX_SAMPLERS]
            for old in dropped:
                self.samplers.pop(old.id, None)
        return dropped

    def model_of_job(self, job_id: str) -> TrainingModel | None:
        return next((m for m in list(self.models.values()) if m.job_id == job_id), None)

    def record(self, owner: str, ids: list[str], prompt: list[int], sequences: list[dict[str, Any]]) -> None:
        shared = array("i", prompt)
        with self._lock:
            for sequence_id, seq in zip(ids, sequences, strict=False):
                logprobs = array("f", [float("nan") if v is None else v for v in seq.get("logprobs") or []])
                self.sequences[sequence_id] = Recorded(owner, shared, array("i", seq["tokens"]), logprobs)
                self._recorded_tokens[owner] = (
                    self._recorded_tokens.get(owner, 0) + len(prompt) + len(seq["tokens"])
                )
            over, oldest = self._recorded_tokens[owner] - MAX_RECORDED_TOKENS, []
            for key, old in self.sequences.items():  # the owner's oldest, no more than it is over by
                if over <= 0:
                    break
                if old.owner == owner:
                    oldest.append(key)
                    over -= len(old.prompt) + len(old.tokens)
            for key in oldest:
                self._drop(key)

    def _drop(self, key: str) -> None:
        old = self.sequences.pop(key)
        self._recorded_tokens[old.owner] -= len(old.prompt) + len(old.tokens)

    def end_session(self, session_id: str) -> list[Sampler]:
        """The session's samplers (returned) and recorded samples go with it (their ids start with its id)."""
        with self._lock:
            self.sessions.pop(session_id, None)
            dropped = [self.samplers.pop(k) for k in list(self.samplers) if k.startswith(session_id + ":")]
            for key in [k for k in self.sequences if k.startswith(session_id + ":")]:
                self._drop(key)
        return dropped


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
