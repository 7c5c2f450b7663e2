"""The metrics routes and job labels over HTTP: pages, downsampling, export, name/tags/notes.

The series is written into the store of a job cancelled before it ran, so every expected answer is
computed here from the rows written, independently of the service's SQL.
"""

from __future__ import annotations

import csv
import io
from collections.abc import Iterator

import httpx
import pytest

from tests.api_util import tiny_job, wait_for

STEPS = range(1, 201)


def value(step: int) -> dict[str, float]:
    return {"actor/pg_loss": step / 100, "actor/lr": 1e-3, "critic/score/mean": step % 5 / 4}


@pytest.fixture(scope="module")
def api(unscheduled, ray_cluster) -> Iterator[httpx.Client]:
    """The admin's client of a service that starts no job: these tests read and label records only
    (a submission is checked against the cluster: Ray's)."""
    with unscheduled.client() as client:
        yield client


@pytest.fixture(scope="module")
def series_job(unscheduled, api: httpx.Client) -> dict:
    job = api.post("/v1/jobs", json=tiny_job(metadata={"suite": "metrics-api"})).json()
    api.post(f"/v1/jobs/{job['id']}/cancel")
    wait_for(api, job["id"], ("cancelled",), timeout_s=120)
    for step in STEPS:
        unscheduled.service.store.add_metrics(job["id"], step, value(step))
    return job


def steps(api: httpx.Client, job: dict, **params) -> list[int]:
    response = api.get(f"/v1/jobs/{job['id']}/metrics", params=params)
    assert response.status_code == 200, response.text
    return [r["step"] for r in response.json()["data"]]


def test_keys_by_name_and_prefix(api, series_job):
    rows = api.get(
        f"/v1/jobs/{series_job['id']}/metrics", params={"keys": "actor/*,critic/score/mean"}
    ).json()
    assert rows["data"][9]["values"] == value(10)
    only = api.get(f"/v1/jobs/{series_job['id']}/metrics", params={"keys": "actor/*", "last": 1}).json()[
        "data"
    ]
    assert only == [{**only[0], "step": 200, "values": {"actor/pg_loss": 2.0, "actor/lr": 1e-3}}]


def test_after_step_last_every_and_max_points(api, series_job):
    assert steps(api, series_job, after_step=197) == [198, 199, 200]
    assert steps(api, series_job, last=4) == [197, 198, 199, 200]
    assert steps(api, series_job, every=50) == [50, 100, 150, 200]
    points = steps(api, series_job, max_points=7)
    assert len(points) == 7 and points[0] == 1 and points[-1] == 200
    spacing = [b - a for a, b in zip(points, points[1:], strict=False)]
    assert max(spacing) - min(spacing) <= 1
    assert steps(api, series_job, max_points=1) == [200]


def test_pages_follow_with_after_step(api, series_job):
    seen, cursor = [], None
    while True:
        params = {"limit": 64} | ({"after_step": cursor} if cursor is not None else {})
        page = api.get(f"/v1/jobs/{series_job['id']}/metrics", params=params).json()
        seen += [r["step"] for r in page["data"]]
        if not page["has_more"]:
            break
        cursor = page["data"][-1]["step"]
    assert seen == list(STEPS)


@pytest.mark.parametrize(
    ("params", "field"),
    [({"every": 0}, "every"), ({"max_points": 0}, "max_points"), ({"last": -1}, "last"),
     ({"after_step": 2**63}, "after_step"), ({"limit": 0}, "limit")],
)  # fmt: skip
def test_bad_query_values_are_422_naming_the_field(api, series_job, params, field):
    response = api.get(f"/v1/jobs/{series_job['id']}/metrics", params=params)
    assert response.status_code == 422
    assert field in response.text


def test_export_as_csv_and_json(api, series_job):
    url = f"/v1/jobs/{series_job['id']}/metrics/export"
    as_csv = api.get(url, params={"format": "csv", "keys": "actor/*"})
    assert as_csv.status_code == 200 and as_csv.headers["content-type"].startswith("text/csv")
    table = list(csv.DictReader(io.StringIO(as_csv.text)))
    assert [int(r["step"]) for r in table] == list(STEPS)
    assert set(table[0]) == {"step", "time", "actor/lr", "actor/pg_loss"}
    assert float(table[41]["actor/pg_loss"]) == pytest.approx(value(42)["actor/pg_loss"])
    as_json = api.get(url, params={"format": "json"}).json()
    assert [r["step"] for r in as_json] == list(STEPS) and as_json[-1]["values"] == value(200)
    assert api.get(url, params={"format": "xml"}).status_code == 422


def test_name_tags_notes_at_submit_patch_and_filters(api):
    spec = tiny_job(
        metadata={"suite": "labels"}, name="lr sweep 3", tags=["sweep", "lr-3e-4"], notes="baseline"
    )
    job = api.post("/v1/jobs", json=spec).json()
    api.post(f"/v1/jobs/{job['id']}/cancel")
    assert (job["name"], job["tags"], job["notes"]) == ("lr sweep 3", ["sweep", "lr-3e-4"], "baseline")
    patched = api.patch(f"/v1/jobs/{job['id']}", json={"tags": ["sweep", "keep"], "notes": "diverged at 40"})
    assert patched.status_code == 200, patched.text
    assert patched.json()["tags"] == ["sweep", "keep"] and patched.json()["name"] == "lr sweep 3"
    assert api.get(f"/v1/jobs/{job['id']}").json()["notes"] == "diverged at 40"

    def listed(**params) -> list[str]:
        page = api.get("/v1/jobs", params={"limit": 100, **params}).json()["data"]
        assert all("spec" not in j for j in page)  # list pages are summaries
        return [j["id"] for j in page]

    assert job["id"] in listed(tag="keep") and job["id"] not in listed(tag="lr-3e-4")
    assert job["id"] in listed(q="SWEEP 3") and job["id"] in listed(q="diverged")
    assert job["id"] in listed(q=job["id"][-6:]) and job["id"] not in listed(q="no such words")
    for body, field in (({"tags": [""]}, "tags"), ({"name": "x" * 201}, "name"), ({"bogus": 1}, "bogus"),
                        ({"notes": None}, "notes")):  # fmt: skip
        bad = api.patch(f"/v1/jobs/{job['id']}", json=body)
        assert bad.status_code == 422 and field in bad.json()["error"]["param"], bad.text
    assert api.patch("/v1/jobs/job-nope", json={"name": "x"}).status_code == 404
