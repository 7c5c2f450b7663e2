"""The hot read routes answer from memory until their rows change: every write shows in the next read.

GET /v1/jobs, GET /v1/jobs/{id}/metrics and the token check keep what they read (api/read_cache.py)
until the job store's next commit to their topic (the jobs table, the job's series, the tokens
table). These tests read (so the cache holds the page), write through the API or into the store as
the scheduler does, and assert the next read carries the written values, and that a write to one
topic leaves the others' pages cached. The service runs without its scheduler (jobs stay queued; no Ray needed): jobs are put in
its store as `Service.submit` does.
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from api.auth import hash_token, new_key
from api.errors import APIError
from api.read_cache import ReadCache
from api.views import EncodedSummary, job_summary
from schema.job import JobSpec
from service.store import JobStore, MetricsQuery, metrics_topic
from tests.api_util import tiny_job


@pytest.fixture
def client(unscheduled):
    with unscheduled.client() as http:
        yield http


def new_job(svc, **overrides) -> str:
    spec = JobSpec.model_validate(tiny_job(**overrides)).model_dump(mode="json")
    return svc.service.store.create_job(spec, svc.service.jobs_root).id


def listed(client: httpx.Client, job_id: str) -> dict:
    response = client.get("/v1/jobs", params={"limit": 100})
    assert response.status_code == 200, response.text
    return next(j for j in response.json()["data"] if j["id"] == job_id)


def test_each_write_shows_in_the_next_list(unscheduled, client):
    job_id = new_job(unscheduled)
    assert listed(client, job_id)["name"] is None
    assert client.patch(f"/v1/jobs/{job_id}", json={"name": "first", "tags": ["a"]}).status_code == 200
    assert (listed(client, job_id)["name"], listed(client, job_id)["tags"]) == ("first", ["a"])
    unscheduled.service.store.add_metrics(job_id, 7, {"reward/mean": 0.25})  # as the scheduler drains it
    seen = listed(client, job_id)
    assert (seen["step"], seen["latest_metrics"]) == (7, {"reward/mean": 0.25})
    assert client.post(f"/v1/jobs/{job_id}/cancel").json()["status"] == "cancelled"
    assert listed(client, job_id)["status"] == "cancelled"
    assert client.delete(f"/v1/jobs/{job_id}").status_code == 200
    ids = [j["id"] for j in client.get("/v1/jobs", params={"limit": 100}).json()["data"]]
    assert job_id not in ids
    assert client.get(f"/v1/jobs/{job_id}/metrics").status_code == 404


def test_each_metrics_write_shows_in_the_next_page(unscheduled, client):
    job_id = new_job(unscheduled)
    store = unscheduled.service.store
    path = f"/v1/jobs/{job_id}/metrics"
    assert client.get(path).json()["data"] == []
    for step in (1, 2, 3):
        store.add_metrics(job_id, step, {"loss": step / 2, "n": step})
    rows = client.get(path).json()["data"]
    assert [(r["step"], r["values"]) for r in rows] == [(s, {"loss": s / 2, "n": s}) for s in (1, 2, 3)]
    store.add_metrics(job_id, 2, {"loss": -1.0, "n": 20})  # a resumed run writes step 2 again
    rows = client.get(path, params={"keys": "loss"}).json()["data"]
    assert [r["values"] for r in rows] == [{"loss": 0.5}, {"loss": -1.0}, {"loss": 1.5}]
    store.truncate_after(job_id, 1)
    assert [r["step"] for r in client.get(path).json()["data"]] == [1]
    assert listed(client, job_id)["step"] == 1


def test_a_new_token_works_at_once(unscheduled):
    token = new_key()
    with unscheduled.client(token) as stranger:
        assert stranger.get("/v1/jobs").status_code == 401
        unscheduled.service.store.add_token("reader", hash_token(token), ["read"])
        assert stranger.get("/v1/jobs").status_code == 200
        refused = stranger.post(f"/v1/jobs/{new_job(unscheduled)}/cancel")
        assert refused.status_code == 403 and refused.json()["error"]["code"] == "insufficient_scope"


# ---- the cache itself, on a real store ----------------------------------------------------------


def test_misses_together_share_one_read_and_a_write_forces_another(tmp_path):
    store = JobStore(tmp_path / "t.db")
    cache = ReadCache(store)
    reads: list[int] = []

    def read() -> bytes:
        reads.append(1)
        time.sleep(0.2)  # long enough that every request below arrives while it runs
        return b"page %d" % len(reads)

    async def many() -> list[bytes]:
        return await asyncio.gather(*(cache.get("page", "tokens", read) for _ in range(20)))

    assert asyncio.run(many()) == [b"page 1"] * 20 and len(reads) == 1
    assert asyncio.run(cache.get("page", "tokens", read)) == b"page 1"
    store.add_token("t", "hash", ["read"])  # a committed write to the page's topic
    assert asyncio.run(cache.get("page", "tokens", read)) == b"page 2" and len(reads) == 2


def test_an_error_is_not_kept(tmp_path):
    cache = ReadCache(JobStore(tmp_path / "t.db"))
    answers = iter([APIError(404, "no job 'x'", "job_id", "not_found"), b"found"])

    def read() -> bytes:
        answer = next(answers)
        if isinstance(answer, Exception):
            raise answer
        return answer

    with pytest.raises(APIError):
        asyncio.run(cache.get("job", "jobs", read))
    assert asyncio.run(cache.get("job", "jobs", read)) == b"found"


def test_entries_are_bounded(tmp_path):
    cache = ReadCache(JobStore(tmp_path / "t.db"), max_entries=2, max_bytes=40)
    reads: list[str] = []

    def reader(key: str, size: int):
        return lambda: reads.append(key) or b"x" * size

    for key in ("a", "b", "c", "a"):  # "a" was evicted by "c": read again
        asyncio.run(cache.get(key, "jobs", reader(key, 4)))
    assert reads == ["a", "b", "c", "a"]
    asyncio.run(cache.get("big", "jobs", reader("big", 11)))  # over a quarter of max_bytes: not kept
    asyncio.run(cache.get("big", "jobs", reader("big", 11)))
    assert reads[-2:] == ["big", "big"]


def test_a_write_changes_only_its_topics(tmp_path):
    store = JobStore(tmp_path / "t.db")
    spec = JobSpec.model_validate(tiny_job()).model_dump(mode="json")
    a, b = (store.create_job(spec, tmp_path).id for _ in range(2))
    topics = ("jobs", metrics_topic(a), metrics_topic(b), "tokens", "events", "logs")

    def changed(write) -> set[str]:
        before = {t: store.changes(t) for t in topics}
        write()
        return {t for t in topics if store.changes(t) != before[t]}

    assert changed(lambda: store.add_metrics(a, 1, {"loss": 1.0})) == {"jobs", metrics_topic(a)}
    assert changed(lambda: store.bump_step(a, 1)) == set()  # already at step 1: no row changed
    assert changed(lambda: store.bump_step(a, 4)) == {"jobs"} and store.get_job(a).step == 4
    assert changed(lambda: store.add_event(a, "note", "hello")) == {"events"}
    assert changed(lambda: store.add_logs(a, [(1.0, "INFO", "line")])) == {"logs"}
    assert changed(lambda: store.add_token("t", "h", ["read"])) == {"tokens"}
    assert changed(lambda: store.truncate_after(b, 0)) == {"jobs", metrics_topic(b)}
    assert changed(lambda: store.delete_job(b)) == {"jobs", metrics_topic(b), "events", "logs"}


def test_metrics_written_to_one_job_leave_the_other_pages_cached(unscheduled, client):
    writing, watched = new_job(unscheduled), new_job(unscheduled)
    store, cache = unscheduled.service.store, unscheduled.server.config.app.state.read_cache
    store.add_metrics(watched, 1, {"loss": 0.5})
    page = client.get(f"/v1/jobs/{watched}/metrics").json()["data"]
    listed(client, writing)
    reads = cache.reads
    store.add_metrics(writing, 1, {"loss": 2.0})  # as the scheduler writes a training job's step
    assert client.get(f"/v1/jobs/{watched}/metrics").json()["data"] == page
    assert cache.reads == reads  # the watched series and the token table were not read again
    assert listed(client, writing)["latest_metrics"] == {"loss": 2.0}
    assert cache.reads == reads + 1  # the job list was: the writing job's step changed it


# ---- the encodings the cache keeps are what json.dumps makes -------------------------------------


def test_metrics_rows_as_json_text_equal_the_encoded_rows(tmp_path):
    store = JobStore(tmp_path / "t.db")
    job = store.create_job(JobSpec.model_validate(tiny_job()).model_dump(mode="json"), tmp_path)
    for step in range(1, 8):
        store.add_metrics(job.id, step, {"a/x": step / 3, "a/n": step, "b": float("nan"), "é": 1e-300})
    for query in (MetricsQuery(), MetricsQuery(keys=("a/*",)), MetricsQuery(max_points=3, limit=2)):
        rows, more = store.metrics_page(job.id, query)
        texts, more_json = store.metrics_page_json(job.id, query)
        assert (texts, more_json) == ([json.dumps(r) for r in rows], more)
    assert json.loads(texts[0])["values"] == {"a/x": 1 / 3, "a/n": 1, "b": None, "é": 1e-300}


def test_an_encoded_summary_equals_the_encoded_summary(tmp_path):
    store = JobStore(tmp_path / "t.db")
    job = store.create_job(
        JobSpec.model_validate(tiny_job(name="n", tags=["t"], metadata={"k": "ü"})).model_dump(mode="json"),
        tmp_path,
    )
    store.add_metrics(job.id, 3, {"loss": 0.5})
    record = store.get_job(job.id)
    assert EncodedSummary.of(record).json() == json.dumps(job_summary(record))
