"""Tinker training runs as a workload of the scheduler: a table of their own (none in the jobs
table), a scheduler slot per run within the owner's quotas as a job's, and a store made before the
table opening with its `method: tinker` rows moved into it. One service on a real host."""

from __future__ import annotations

import sqlite3
import time
from pathlib import Path

import httpx
import pytest

pytest.importorskip("tinker")
pytest.importorskip("workers.session_host")

from api.settings import ServeSettings  # noqa: E402
from service.service import Service  # noqa: E402
from service.store import JobStore  # noqa: E402
from tests.api_util import start_service  # noqa: E402
from tests.owners_util import make_key  # noqa: E402

BASE = "tiny-qwen2"
OLD_STORE = Path(__file__).parent / "data" / "store_with_tinker_rows.sql"  # made by the code before the table
RUNNING_RUN, DONE_RUN, RL_JOB = "job-1892f8386ed3", "job-6c8585b5170a", "job-8351f70d9622"


@pytest.fixture(scope="module")
def late_base(tmp_path_factory) -> Path:
    """A served model folder that does not exist when the service starts."""
    return tmp_path_factory.mktemp("late") / "base"


@pytest.fixture(scope="module")
def svc(ray_cluster, tmp_path_factory, late_base):
    settings = ServeSettings(tinker_base_models=[BASE, str(late_base)])
    live = start_service(tmp_path_factory.mktemp("tinker-workload"), settings=settings)
    yield live
    live.stop()


def owner_client(svc, owner: str, **quota) -> httpx.Client:
    with svc.client() as admin:
        key = make_key(admin, owner)["key"]
        if quota:
            assert admin.put(f"/v1/quotas/{owner}", json=quota).status_code == 200
    return httpx.Client(base_url=svc.url, headers={"X-API-Key": key}, timeout=60)


def create_model(client: httpx.Client, session: str, seq: int) -> httpx.Response:
    body = {"session_id": session, "model_seq_id": seq, "base_model": BASE, "lora_config": {"rank": 4}}
    return client.post("/api/v1/create_model", json=body)


def run_of(svc, model_id: str):
    rows = svc.service.store.list_jobs(metadata={"tinker_model_id": model_id}, limit=1)[0]
    return rows[0] if rows else None


def done(svc, request_id: str, within_s: float) -> bool:
    future = svc.server.config.app.state.tinker.futures.get(request_id, None)
    deadline = time.monotonic() + within_s
    while not future.done and time.monotonic() < deadline:
        time.sleep(0.05)
    return future.done and not (isinstance(future.answer, dict) and "error" in future.answer)


def jobs_table_tinker_rows(store: JobStore) -> int:
    return store._db().execute("SELECT COUNT(*) FROM jobs WHERE method = 'tinker'").fetchone()[0]


def test_a_run_takes_a_scheduler_slot_and_waits_at_its_owners_running_jobs_quota(svc):
    with owner_client(svc, "quinn", running_jobs=1) as quinn:
        session = quinn.post("/api/v1/create_session", json={"tags": []}).json()["session_id"]
        first = create_model(quinn, session, 0).json()["request_id"]
        assert done(svc, first, 120)
        run = run_of(svc, f"{session}:train:0")
        assert run.status == "running" and run.id in svc.service.scheduler.running
        usage = quinn.get("/v1/usage").json()["data"][0]
        assert usage["running_jobs"] == 1
        # the owner is at its quota: the second run waits in the queue, as a job would
        second = create_model(quinn, session, 1).json()["request_id"]
        assert not done(svc, second, 1.5)
        waiting = run_of(svc, f"{session}:train:1")
        assert waiting.status == "queued" and waiting.id not in svc.service.scheduler.running
        assert quinn.get("/v1/usage").json()["data"][0]["queued_jobs"] == 1
        unload = quinn.post("/api/v1/unload_model", json={"model_id": f"{session}:train:0"}).json()[
            "request_id"
        ]
        assert done(svc, unload, 60)
        assert done(svc, second, 60)  # the slot freed: the scheduler started it
        assert run_of(svc, f"{session}:train:0").status == "succeeded"
        assert run_of(svc, f"{session}:train:1").status == "running"
    assert jobs_table_tinker_rows(svc.service.store) == 0


def test_a_run_past_the_owners_queued_jobs_quota_is_refused_and_stores_nothing(svc):
    with owner_client(svc, "rhea", queued_jobs=0) as rhea:
        session = rhea.post("/api/v1/create_session", json={"tags": []}).json()["session_id"]
        refused = create_model(rhea, session, 0)
    assert refused.status_code == 403 and refused.json()["param"] == "quota.queued_jobs", refused.text
    assert run_of(svc, f"{session}:train:0") is None


def test_the_jobs_table_holds_no_tinker_rows_while_the_listing_shows_runs(svc):
    with owner_client(svc, "sven") as sven:
        session = sven.post("/api/v1/create_session", json={"tags": []}).json()["session_id"]
        assert done(svc, create_model(sven, session, 0).json()["request_id"], 120)
        listed = sven.get("/v1/jobs").json()["data"]
    assert [(j["method"], j["metadata"]["tinker_model_id"]) for j in listed] == [
        ("tinker", f"{session}:train:0")
    ]
    store = svc.service.store
    assert jobs_table_tinker_rows(store) == 0
    assert store._db().execute("SELECT COUNT(*) FROM tinker_runs WHERE owner = 'sven'").fetchone()[0] == 1


def failure(svc, request_id: str) -> str:
    future = svc.server.config.app.state.tinker.futures[request_id]
    assert future.done and isinstance(future.answer, dict), future
    return future.answer["error"]


def test_a_run_that_ends_before_its_launch_fails_its_held_requests_and_holds_nothing(svc):
    """A run waiting in the queue (its owner at quota) holds its client's requests until the scheduler
    launches it. Cancelled through Tandem's API, or paused when its session expires, it never will:
    each held request fails at once, naming why, and the service keeps nothing of it."""
    tinker = svc.server.config.app.state.tinker
    with owner_client(svc, "uma", running_jobs=1) as uma:
        # the owner's one slot held by a run of another session, so the next runs wait in the queue
        holder = uma.post("/api/v1/create_session", json={"tags": []}).json()["session_id"]
        assert done(svc, create_model(uma, holder, 0).json()["request_id"], 120)
        session = uma.post("/api/v1/create_session", json={"tags": []}).json()["session_id"]
        cancelled = create_model(uma, session, 0).json()["request_id"]
        expired = create_model(uma, session, 1).json()["request_id"]
        assert not done(svc, cancelled, 1.0)
        run = run_of(svc, f"{session}:train:0")
        assert run.status == "queued" and f"{session}:train:0" in tinker._launches
        assert uma.post(f"/v1/jobs/{run.id}/cancel").json()["status"] == "cancelled"
        assert "cancelled through Tandem's API" in failure(svc, cancelled)
        ttl = tinker.session_ttl_s
        tinker.session_ttl_s = 0.0
        try:
            time.sleep(0.05)
            tinker.expire_sessions()  # both sessions: the holder's run pauses too
        finally:
            tinker.session_ttl_s = ttl
        assert f"session {session} ended" in failure(svc, expired)
        assert run_of(svc, f"{session}:train:1").status == "paused"
    assert not any(k.startswith((session, holder)) for k in tinker._launches)
    assert not tinker.records.models.of("uma")


def test_a_silent_session_ends_though_no_other_client_calls(svc):
    """Its client stopped (no heartbeat) and nobody else calls the Tinker API: the session still ends
    within its TTL, and its run pauses, freeing its owner's running slot."""
    tinker = svc.server.config.app.state.tinker
    with owner_client(svc, "walt") as walt:
        session = walt.post("/api/v1/create_session", json={"tags": []}).json()["session_id"]
        assert done(svc, create_model(walt, session, 0).json()["request_id"], 120)
    ttl = tinker.session_ttl_s
    tinker.session_ttl_s = 1.0
    try:
        deadline = time.monotonic() + 30
        while session in tinker.records.sessions and time.monotonic() < deadline:
            time.sleep(0.1)
    finally:
        tinker.session_ttl_s = ttl
    assert session not in tinker.records.sessions
    run = run_of(svc, f"{session}:train:0")
    assert run.status == "paused" and f"session {session} ended" in run.error
    assert run.id not in svc.service.scheduler.running


def test_a_host_that_failed_to_start_starts_with_the_next_request(svc, late_base):
    """Its model folder is copied in after the first request: that request fails naming the host, and
    the next one starts it."""
    from engines.models.tiny_models import TinyModelSpec, build_tiny_model

    with owner_client(svc, "vera") as vera:
        session = vera.post("/api/v1/create_session", json={"tags": []}).json()["session_id"]
        body = {
            "session_id": session,
            "model_seq_id": 0,
            "base_model": str(late_base),
            "lora_config": {"rank": 2},
        }
        first = vera.post("/api/v1/create_model", json=body).json()["request_id"]
        assert not done(svc, first, 60)
        assert f"session host '{late_base}' failed to start" in failure(svc, first)
        build_tiny_model(late_base, TinyModelSpec())
        second = vera.post("/api/v1/create_model", json=body).json()["request_id"]
        assert done(svc, second, 120), failure(svc, second)
        assert run_of(svc, f"{session}:train:0").status == "running"
        assert vera.post("/api/v1/unload_model", json={"model_id": f"{session}:train:0"}).status_code == 200


def test_a_store_with_tinker_rows_in_the_jobs_table_opens_with_them_moved(ray_cluster, tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    with sqlite3.connect(home / "tandem.db") as db:
        db.executescript(OLD_STORE.read_text())
    store = JobStore(home / "tandem.db")
    assert jobs_table_tinker_rows(store) == 0
    moved = store.get_job(RUNNING_RUN)
    assert (moved.method, moved.owner, moved.status, moved.step) == ("tinker", "alice", "running", 1)
    assert moved.metadata["tinker_model_id"] == "sess-0123456789ab:train:0"
    assert moved.spec["model"]["lora"]["rank"] == 8 and moved.latest_metrics == {"train/loss:sum": 3.5}
    assert [m["values"] for m in store.metrics_since(RUNNING_RUN)] == [{"train/loss:sum": 3.5}]
    assert [j.id for j in store.list_jobs()[0]] == [DONE_RUN, RUNNING_RUN, RL_JOB]  # the same order
    assert store.get_job(DONE_RUN).status == "succeeded" and store.get_job(RL_JOB).method == "grpo"
    # the scheduler's recovery pauses the run left running: its adapter went with the old service
    store.transition(RL_JOB, ("queued",), "cancelled")  # not run here: its workdir is another machine's
    service = Service(home, warm_controllers=0)
    service.start()
    try:
        paused = service.store.get_job(RUNNING_RUN)
        assert paused.status == "paused" and "saved no state" in paused.error
    finally:
        service.shutdown(timeout_s=5)
    assert JobStore(home / "tandem.db").get_job(RUNNING_RUN).status == "paused"  # opening again moves nothing
