"""The Tinker API's records: client sessions, training models, samplers, and who owns each.

- A client session (`create_session`, kept alive by `session_heartbeat`) lives in memory: the SDK
  makes a new one per process, so there is nothing to keep across a restart.
- A training model (`create_model`, a LoRA adapter on a served base) is also a record of the
  scheduler's Tinker workload, a row of the store's `tinker_runs` table (service/store_tinker.py),
  so it shows in `tandem list` and the dashboard with its owner, per-step metrics and samples; its
  id there (`job-...`) is the Tinker training run id of its checkpoint paths
  (`tinker://job-.../weights/NAME`). Its checkpoints are folders under the row's workdir
  (`checkpoints/weights/NAME`, `checkpoints/sampler_weights/NAME`), so they outlive the service.
  After a restart the adapter itself is gone (it lived in the host process): the scheduler's
  recovery pauses the run (`TinkerRunWorkload.recover`), and the model's next call is refused with
  its last saved state named (`lost_message`).
- A sampler (`save_weights_for_sampler`, `create_sampling_session`) is a frozen adapter snapshot
  or the bare base model, in memory.

Every lookup takes the caller's owner (None: the admin, who sees everyone's) and answers None for
another owner's id, so that it is a 404, like an unknown one.
"""

from __future__ import annotations

import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

METHOD = "tinker"
CHECKPOINT_KINDS = {"weights": "training", "sampler_weights": "sampler"}


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
class Sampler:
    id: str
    owner: str
    base_model: str
    path: str | None  # the snapshot folder on the host's disk; None = the base model
    tinker_path: str | None
    job_id: str | None  # the training run it came from: its samples go to that row


def sees(owner_of: str, caller_owner: str | None) -> bool:
    return caller_owner is None or owner_of == caller_owner


def _seen(found: Any, owner: str | None) -> Any:
    return found if found is not None and sees(found.owner, owner) else None


class Records:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.sessions: dict[str, ClientSession] = {}
        self.models: dict[str, TrainingModel] = {}
        self.samplers: dict[str, Sampler] = {}

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

    def live_models_of(self, owner: str) -> int:
        return sum(1 for m in list(self.models.values()) if m.owner == owner)

    def live_sessions_of(self, owner: str) -> int:
        return sum(1 for s in list(self.sessions.values()) if s.owner == owner)


def checkpoint_folder(workdir: Path, kind: str, name: str) -> Path:
    """Where a checkpoint of a training run lives: kind is `weights` or `sampler_weights`."""
    return Path(workdir) / "checkpoints" / kind / name


def list_checkpoints(job_id: str, workdir: Path) -> list[dict[str, Any]]:
    """The run's checkpoints on disk, oldest first, in the SDK's `Checkpoint` shape."""
    out = []
    for kind, label in CHECKPOINT_KINDS.items():
        root = Path(workdir) / "checkpoints" / kind
        if not root.is_dir():
            continue
        for folder in root.iterdir():
            if not (folder / ".complete").exists():
                continue
            size = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())
            out.append({
                "checkpoint_id": f"{kind}/{folder.name}",
                "checkpoint_type": label,
                "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(folder.stat().st_mtime)),
                "tinker_path": f"tinker://{job_id}/{kind}/{folder.name}",
                "size_bytes": size,
                "public": False,
                "mtime": folder.stat().st_mtime,
            })  # fmt: skip
    out.sort(key=lambda c: c.pop("mtime"))
    return out


def parse_tinker_path(path: str) -> tuple[str, str, str] | None:
    """(training run id, kind, name) of `tinker://RUN/KIND/NAME`, or None."""
    if not path.startswith("tinker://"):
        return None
    parts = path[len("tinker://") :].split("/")
    if len(parts) != 3 or parts[1] not in CHECKPOINT_KINDS or not parts[0] or not parts[2]:
        return None
    if any(p in (".", "..") or "\\" in p for p in parts):
        return None
    return parts[0], parts[1], parts[2]


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


def run_row(store: Any, run_id: str, owner: str | None) -> Any:
    """The store's record of Tinker training run `run_id`, if `owner` may see it (None: the admin)."""
    job = store.get_job(run_id)
    return job if job is not None and job.method == METHOD and sees(job.owner, owner) else None
