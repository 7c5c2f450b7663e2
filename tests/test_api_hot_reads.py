"""Repeated GETs of the job list and a job's metrics answered before FastAPI (api/read_cache.py).

A query the route answered once is answered again from the read cache without FastAPI: the same
body and headers, live fields computed per request, and every other request (a new query, a bad or
missing token, a token without the read scope) answered by FastAPI as before. The service runs
without its scheduler (no Ray): jobs are put in its store as `Service.submit` does.
"""

from __future__ import annotations

import time
import uuid
from pathlib import Path

import httpx
import pytest

from api.auth import hash_token, new_key
from schema.job import JobSpec
from tests.api_util import tiny_job

SENT_PER_REQUEST = ("x-request-id", "date")


@pytest.fixture
def client(unscheduled):
    with unscheduled.client() as http:
        yield http


def hot(svc):
    return svc.server.config.app.state.hot_reads


def tagged_job(svc) -> tuple[str, str]:
    """A new job with a tag of its own, so a list filtered by it holds that job alone."""
    tag = "t" + uuid.uuid4().hex[:8]
    spec = JobSpec.model_validate(tiny_job(tags=[tag])).model_dump(mode="json")
    return svc.service.store.create_job(spec, svc.service.jobs_root).id, tag


def fixed_headers(response: httpx.Response) -> dict[str, str]:
    return {k: v for k, v in response.headers.items() if k not in SENT_PER_REQUEST}


def test_a_repeated_query_is_answered_before_fastapi_with_the_same_response(unscheduled, client):
    job_id, tag = tagged_job(unscheduled)
    for step in (1, 2, 3):
        unscheduled.service.store.add_metrics(job_id, step, {"loss": step / 4, "reward": -step})
    for url in (f"/v1/jobs?tag={tag}&limit=5", f"/v1/jobs/{job_id}/metrics?keys=loss&max_points=2"):
        first = client.get(url)  # FastAPI validates the query and answers: the query is learned
        hits = hot(unscheduled).hits
        again = client.get(url, headers={"x-request-id": "mine"})
        assert hot(unscheduled).hits == hits + 1, url
        assert (again.status_code, again.content) == (200, first.content)
        assert fixed_headers(again) == fixed_headers(first)
        assert again.headers["x-request-id"] == "mine"
    rows = client.get(f"/v1/jobs/{job_id}/metrics?keys=loss&max_points=2").json()["data"]
    assert [(r["step"], r["values"]) for r in rows] == [(1, {"loss": 0.25}), (3, {"loss": 0.75})]
    assert [j["id"] for j in client.get(f"/v1/jobs?tag={tag}&limit=5").json()["data"]] == [job_id]


def test_a_write_shows_in_the_next_hot_read(unscheduled, client):
    job_id, tag = tagged_job(unscheduled)
    table, cache = hot(unscheduled), unscheduled.server.config.app.state.read_cache
    url = f"/v1/jobs/{job_id}/metrics?max_points=10"
    assert client.get(url).json()["data"] == [] and client.get(url).json()["data"] == []
    unscheduled.service.store.add_metrics(job_id, 1, {"loss": 3.0})
    hits, reads = table.hits, cache.reads
    assert [r["values"] for r in client.get(url).json()["data"]] == [{"loss": 3.0}]
    assert (table.hits, cache.reads) == (hits + 1, reads + 1)  # read again by the hot path, once
    listing = f"/v1/jobs?tag={tag}"
    assert client.get(listing).json()["data"][0]["name"] is None
    assert client.patch(f"/v1/jobs/{job_id}", json={"name": "renamed"}).status_code == 200
    assert client.get(listing).json()["data"][0]["name"] == "renamed"


def test_live_fields_are_computed_for_each_hot_read(unscheduled, client):
    job_id, tag = tagged_job(unscheduled)
    store = unscheduled.service.store
    assert store.transition(job_id, ("queued",), "running")  # its running time now counts
    url = f"/v1/jobs?tag={tag}"
    first = client.get(url).json()["data"][0]
    assert first["outputs"]["export"] is None
    changes, hits = store.changes("jobs"), hot(unscheduled).hits
    time.sleep(0.05)
    later = client.get(url).json()["data"][0]
    assert later["active_seconds"] >= first["active_seconds"] + 0.04
    export = Path(first["outputs"]["workdir"], "export")
    export.mkdir(parents=True)
    (export / "config.json").write_text("{}")  # the HF export appears on disk, with no store write
    assert client.get(url).json()["data"][0]["outputs"]["export"] == str(export)
    assert (store.changes("jobs"), hot(unscheduled).hits) == (changes, hits + 2)


def test_tokens_are_checked_on_hot_reads_as_on_every_route(unscheduled, client):
    job_id, _ = tagged_job(unscheduled)
    writer = new_key()
    unscheduled.service.store.add_token("writer", hash_token(writer), ["write"])
    learned, fresh = f"/v1/jobs/{job_id}/metrics?limit=3", f"/v1/jobs/{job_id}/metrics?limit=4"
    assert client.get(learned).status_code == 200 and client.get(learned).status_code == 200
    hits = hot(unscheduled).hits
    cases = {
        "no header": ({}, 401, "missing_token"),
        "not bearer": ({"Authorization": "Basic abc"}, 401, "missing_token"),
        "unknown token": ({"Authorization": "Bearer " + new_key()}, 401, "invalid_token"),
        "no read scope": ({"Authorization": f"Bearer {writer}"}, 403, "insufficient_scope"),
    }
    for name, (headers, status, code) in cases.items():
        refused = httpx.get(unscheduled.url + learned, headers=headers)
        assert (refused.status_code, refused.json()["error"]["code"]) == (status, code), name
        # the same answer as FastAPI gives on a query it never learned
        assert refused.json() == httpx.get(unscheduled.url + fresh, headers=headers).json(), name
        assert fixed_headers(refused).get("www-authenticate") == (
            'Bearer realm="tandem"' if status == 401 else None
        )
    assert hot(unscheduled).hits == hits


def test_bad_queries_are_never_answered_hot(unscheduled, client):
    job_id, _ = tagged_job(unscheduled)
    hits = hot(unscheduled).hits
    for url in (f"/v1/jobs/{job_id}/metrics?limit=0", "/v1/jobs?status=bogus", "/v1/jobs?after=job-nope"):
        codes = {client.get(url).status_code for _ in range(2)}
        assert codes <= {404, 422} and len(codes) == 1, url
    assert client.get("/v1/jobs/job-nope/metrics").status_code == 404
    assert client.get("/v1/jobs/job-nope/metrics").status_code == 404
    assert hot(unscheduled).hits == hits


def test_a_deleted_job_is_not_served_from_a_learned_query(unscheduled, client):
    job_id, tag = tagged_job(unscheduled)
    url = f"/v1/jobs/{job_id}/metrics?keys=loss"
    assert client.get(url).status_code == 200 and client.get(url).status_code == 200
    assert client.post(f"/v1/jobs/{job_id}/cancel").status_code == 200
    assert client.delete(f"/v1/jobs/{job_id}").status_code == 200
    hits = hot(unscheduled).hits
    gone = client.get(url)  # the learned read fails: FastAPI reads again and answers the 404
    assert gone.status_code == 404 and gone.json()["error"]["param"] == "job_id"
    assert hot(unscheduled).hits == hits
    assert client.get(f"/v1/jobs?tag={tag}").json()["data"] == []


def test_the_learned_queries_are_bounded(unscheduled, client):
    table = hot(unscheduled)
    job_id, _ = tagged_job(unscheduled)
    urls = [f"/v1/jobs/{job_id}/metrics?limit={n}" for n in (11, 12, 13)]
    table.max_queries, kept = 2, table.max_queries
    try:
        table._learned.clear()
        for url in urls:
            assert client.get(url).status_code == 200
        hits = table.hits
        client.get(urls[0])  # forgotten when the third was learned: FastAPI answers (and learns it)
        assert table.hits == hits
        client.get(urls[2])
        assert table.hits == hits + 1
    finally:
        table.max_queries = kept


def test_hot_reads_are_timed_under_their_route(unscheduled, client):
    job_id, _ = tagged_job(unscheduled)
    url = f"/v1/jobs/{job_id}/metrics?limit=5"
    label = 'tandem_request_seconds_count{method="GET",route="/v1/jobs/{job_id}/metrics",status="200"}'

    def count() -> float:
        line = next((x for x in client.get("/metrics").text.splitlines() if x.startswith(label)), None)
        return float(line.split()[-1]) if line else 0.0

    client.get(url)
    before, hits = count(), hot(unscheduled).hits
    for _ in range(3):
        client.get(url)
    assert hot(unscheduled).hits == hits + 3 and count() == before + 3
