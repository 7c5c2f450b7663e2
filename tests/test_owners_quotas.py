"""Quotas per owner: set live by the admin (and by `tandem serve` flags or a quotas file), refused
with 429 + Retry-After (queued jobs) or 403 (stored bytes, a job bigger than the quota) naming the
quota, with nothing created; usage per owner at /v1/usage; and the fair order in which the
scheduler starts queued jobs. The service runs without its scheduler: refusals happen before any job could."""

from __future__ import annotations

import pytest
import yaml

from api.cli import parse_args
from api.cli_serve import given_settings
from api.settings import ServeSettings
from service.job_state import JobStatus
from service.quotas import Quota, Usage, fair_order, may_run
from tests.api_util import tiny_job
from tests.owners_util import as_key, make_key, owned_job, upload


def line(size: int) -> bytes:
    """A JSONL line of exactly `size` bytes."""
    return b'{"p": "' + b"x" * (size - 10) + b'"}\n'


ONE_CPU = {"resources": {"workers": 1, "cpus_per_worker": 1}}


@pytest.fixture(scope="module")
def admin(unscheduled, ray_cluster):  # a job's needs count the GPUs it takes by default: Ray says how many
    with unscheduled.client() as client:
        yield client


def owner(unscheduled, admin, name: str, **quota):
    assert admin.put(f"/v1/quotas/{name}", json=quota).status_code == 200
    return as_key(unscheduled, make_key(admin, name)["key"])


def refused(response, status: int, quota: str, limit: str) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert (error["param"], error["code"]) == (f"quota.{quota}", "quota_exceeded")
    assert quota in error["message"] and f"at most {limit}" in error["message"]
    return error


def test_a_submission_past_the_queued_jobs_quota_is_a_429_with_retry_after_and_creates_nothing(
    unscheduled, admin
):
    qa = owner(unscheduled, admin, "queuer", queued_jobs=1)
    owned_job(unscheduled, "queuer", checkpoint=False, **ONE_CPU)
    paused = owned_job(unscheduled, "queuer", checkpoint=False, **ONE_CPU)
    unscheduled.service.store.transition(paused, (JobStatus.QUEUED,), JobStatus.PAUSED)
    before = unscheduled.service.store.jobs_of("queuer")
    answer = qa.post("/v1/jobs", json=tiny_job(**ONE_CPU), headers={"Idempotency-Key": "q1"})
    refused(answer, 429, "queued_jobs", "1")
    assert int(answer.headers["retry-after"]) > 0
    refused(qa.post(f"/v1/jobs/{paused}/resume"), 429, "queued_jobs", "1")
    assert unscheduled.service.store.jobs_of("queuer") == before  # nothing created, nothing moved
    assert admin.get("/v1/audit", params={"owner": "queuer"}).json()["data"] == []
    assert qa.get("/v1/usage").json()["data"][0]["queued_jobs"] == 1


def test_a_queued_jobs_quota_of_0_allows_no_submissions_and_says_so(unscheduled, admin):
    """Every job is queued before it starts, the submitted one included: 0 is a hard 403, never a
    Retry-After that cannot clear, and the message counts the job being submitted."""
    none = owner(unscheduled, admin, "no-queue", queued_jobs=0)
    answer = none.post("/v1/jobs", json=tiny_job(**ONE_CPU))
    error = refused(answer, 403, "queued_jobs", "0")
    assert "retry-after" not in answer.headers
    assert "it has 0 and this request adds 1" in error["message"] and "allows none" in error["message"]
    assert unscheduled.service.store.jobs_of("no-queue") == []


def test_a_job_bigger_than_the_owners_cpus_is_a_403(unscheduled, admin):
    small = owner(unscheduled, admin, "small", cpus=1)
    answer = small.post("/v1/jobs", json=tiny_job(resources={"workers": 2, "cpus_per_worker": 1}))
    refused(answer, 403, "cpus", "1")
    assert unscheduled.service.store.jobs_of("small") == []


def test_stored_bytes_refuse_an_upload_and_a_submission_and_keep_nothing(unscheduled, admin):
    keeper = owner(unscheduled, admin, "keeper", stored_bytes=100)
    upload(keeper, "a.jsonl", line(60))
    refused(keeper.post("/v1/files", params={"filename": "b.jsonl"}, content=line(60),
                        headers={"content-type": "application/octet-stream"}), 403, "stored_bytes", "100")  # fmt: skip
    assert [f["filename"] for f in keeper.get("/v1/files").json()["data"]] == ["a.jsonl"]
    assert sum(1 for _ in unscheduled.service.files.root.iterdir()) == len(
        unscheduled.service.files.records()
    )
    upload(keeper, "c.jsonl", line(40))  # exactly at the quota
    refused(keeper.post("/v1/jobs", json=tiny_job(**ONE_CPU)), 403, "stored_bytes", "100")
    refused(keeper.post("/v1/files", params={"filename": "d.jsonl"}, content=b"{}\n",
                        headers={"content-type": "application/octet-stream"}), 403, "stored_bytes", "100")  # fmt: skip
    used = keeper.get("/v1/usage").json()["data"]
    assert [(u["owner"], u["stored_bytes"]["files"], u["quota"]["stored_bytes"]) for u in used] == [
        ("keeper", 100, 100)
    ]


def test_usage_is_per_owner_and_admins_see_every_owner(unscheduled, admin):
    alice = owner(unscheduled, admin, "alice-u")
    owned_job(unscheduled, "alice-u")  # with a checkpoint on disk
    mine = alice.get("/v1/usage", params={"owner": "admin"}).json()["data"]  # the filter is the admin's only
    assert [u["owner"] for u in mine] == ["alice-u"] and mine[0]["queued_jobs"] == 1
    assert mine[0]["stored_bytes"]["checkpoints"] > 0
    everyone = {u["owner"] for u in admin.get("/v1/usage").json()["data"]}
    assert {"alice-u", "admin"} <= everyone
    assert [u["owner"] for u in admin.get("/v1/usage", params={"owner": "alice-u"}).json()["data"]] == [
        "alice-u"
    ]


def test_quotas_change_live_and_come_from_flags_and_a_file(unscheduled, admin, tmp_path):
    assert admin.put("/v1/quotas/default", json={"queued_jobs": 5}).status_code == 200
    assert admin.get("/v1/quotas").json()["default"]["queued_jobs"] == 5
    assert admin.delete("/v1/quotas/default").json()["default"]["queued_jobs"] is None
    assert admin.put("/v1/quotas/x", json={"queued_jobs": -1}).json()["error"]["param"] == "queued_jobs"
    path = tmp_path / "quotas.yaml"
    path.write_text(
        yaml.safe_dump({"default": {"running_jobs": 2, "gpus": 1}, "owners": {"lab": {"gpus": 8}}})
    )
    args = parse_args(["serve", "--quotas", str(path), "--quota-running-jobs", "3", "--quota-stored-gb", "1"])
    book = ServeSettings(**given_settings(args)).quota_book()
    assert book.of("anyone") == Quota(running_jobs=3, gpus=1, stored_bytes=1024**3)  # the flags over the file
    assert book.of("lab") == Quota(gpus=8) and book.of("admin") == Quota()  # the admin is never limited


def test_queued_jobs_start_in_rounds_by_owner_and_an_owner_at_its_quota_waits(unscheduled):
    store = unscheduled.service.store
    a = [owned_job(unscheduled, "fair-a", checkpoint=False, **ONE_CPU) for _ in range(4)]
    b = [owned_job(unscheduled, "fair-b", checkpoint=False, **ONE_CPU)]
    c = [owned_job(unscheduled, "fair-c", checkpoint=False, **ONE_CPU) for _ in range(2)]
    queued = [j for j in store.jobs_in((JobStatus.QUEUED,)) if j.owner.startswith("fair-")]
    order = [j.id for j in fair_order(queued, {})]
    assert order == [a[0], b[0], c[0], a[1], c[1], a[2], a[3]]  # not a[0..3] first: b and c are not starved
    # an owner already running more, or served more recently, goes after the others in each round
    assert [j.id for j in fair_order(queued, {"fair-a": 1})][:3] == [b[0], c[0], a[0]]
    assert [j.id for j in fair_order(queued, {}, {"fair-a": 2, "fair-b": 1})][:3] == [c[0], b[0], a[0]]
    assert may_run(Quota(running_jobs=1), Usage("fair-a"), 1, 0)
    assert not may_run(Quota(running_jobs=1), Usage("fair-a", running_jobs=1), 1, 0)
    assert not may_run(Quota(cpus=2), Usage("fair-a", cpus=1.5), 1, 0)


def test_serve_refuses_a_bad_quotas_file_before_starting_anything(tmp_path):
    from api.server import serve

    bad = tmp_path / "quotas.json"
    bad.write_text('{"default": {"queued_jobs": -1}}')
    for path, why in ((bad, "queued_jobs"), (tmp_path / "missing.json", "No such file")):
        with pytest.raises(SystemExit, match=f"quotas file {path}: .*{why}"):
            serve(home=tmp_path / "home", port=0, settings=ServeSettings(quotas_file=path))
