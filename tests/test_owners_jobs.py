"""Jobs belong to the key that submits or forks them: against a real service on the tests' Ray (its
scheduler not started, so jobs stay queued), submit, Idempotency-Key and fork as two owners; and the
real scheduler starting two owners' queued jobs in fair order."""

from __future__ import annotations

import time

import pytest

from api.settings import ServeSettings
from service.quotas import Quota
from tests.api_util import start_service, tiny_job, wait_for
from tests.owners_util import admin_and_owners, owned_job


@pytest.fixture(scope="module")
def shared(ray_cluster, tmp_path_factory):
    svc = start_service(tmp_path_factory.mktemp("owners-jobs"), schedule=False)
    with admin_and_owners(svc, "alice", "bob") as (admin, alice, bob):
        yield svc, admin, alice, bob
    svc.stop()


def test_a_submitted_job_is_its_submitters_and_idempotency_keys_are_per_owner(shared):
    svc, admin, alice, bob = shared
    spec = tiny_job(metadata={"suite": "owners"})
    first = alice.post("/v1/jobs", json=spec, headers={"Idempotency-Key": "same-key"})
    assert first.status_code == 201 and first.json()["owner"] == "alice", first.text
    again = alice.post("/v1/jobs", json=spec, headers={"Idempotency-Key": "same-key"})
    assert (again.status_code, again.json()["id"]) == (200, first.json()["id"])
    bobs = bob.post("/v1/jobs", json=spec, headers={"Idempotency-Key": "same-key"})
    assert (
        bobs.status_code == 201 and bobs.json()["id"] != first.json()["id"] and bobs.json()["owner"] == "bob"
    )
    assert bob.get(f"/v1/jobs/{first.json()['id']}").status_code == 404
    assert admin.get(f"/v1/jobs/{first.json()['id']}").json()["owner"] == "alice"
    created = admin.post("/v1/jobs", json=spec).json()
    assert created["owner"] == "admin" and alice.get(f"/v1/jobs/{created['id']}").status_code == 404


def test_a_fork_belongs_to_the_forking_key_and_another_owners_job_cannot_be_forked(shared):
    svc, admin, alice, bob = shared
    parent = owned_job(svc, "alice")
    refused = bob.post(f"/v1/jobs/{parent}/fork", json={"overrides": {"trainer": {"total_steps": 5}}})
    assert refused.status_code == 404 and refused.json()["error"]["param"] == "job_id"
    mine = alice.post(f"/v1/jobs/{parent}/fork", json={"overrides": {"trainer": {"total_steps": 5}}})
    assert mine.status_code == 201, mine.text
    assert (mine.json()["owner"], mine.json()["parent_id"]) == ("alice", parent)
    by_admin = admin.post(
        f"/v1/jobs/{parent}/fork", json={"overrides": {"trainer": {"total_steps": 5}}}
    ).json()
    assert by_admin["owner"] == "admin" and alice.get(f"/v1/jobs/{by_admin['id']}").status_code == 404
    assert {j["id"] for j in bob.get("/v1/jobs").json()["data"]}.isdisjoint({parent, mine.json()["id"]})


def test_the_scheduler_starts_queued_jobs_in_rounds_by_owner(ray_cluster, tmp_path):
    """Each job needs the whole test cluster (8 CPUs), so they start one at a time; each is cancelled
    as soon as it starts (during start-up its actor is killed at once), which lets the next start.
    Queued before the scheduler starts: alice's three, then bob's one."""
    svc = start_service(tmp_path, schedule=False)
    try:
        whole = {"resources": {"workers": 1, "cpus_per_worker": 8}}
        a = [owned_job(svc, "alice", checkpoint=False, **whole) for _ in range(3)]
        b = owned_job(svc, "bob", checkpoint=False, **whole)
        svc.service.start()
        started: list[str] = []
        with svc.client() as admin:
            deadline = time.time() + 120
            while len(started) < 4 and time.time() < deadline:
                running = [
                    j["id"] for j in admin.get("/v1/jobs", params={"status": "running"}).json()["data"]
                ]
                assert len(running) <= 1
                for job_id in running:
                    started.append(job_id)
                    assert admin.post(f"/v1/jobs/{job_id}/cancel").status_code == 200
                    wait_for(admin, job_id, ("cancelled",), timeout_s=60)
                time.sleep(0.1)
        assert started == [a[0], b, a[1], a[2]]  # first-come-first-served would be a0, a1, a2, b
    finally:
        svc.stop()


def test_an_owner_at_its_running_jobs_quota_waits_while_another_owners_job_starts(ray_cluster, tmp_path):
    svc = start_service(tmp_path, schedule=False, settings=ServeSettings(default_quota=Quota(running_jobs=1)))
    try:
        one = {"resources": {"workers": 1, "cpus_per_worker": 1}}
        a = [owned_job(svc, "alice", checkpoint=False, **one) for _ in range(2)]
        b = owned_job(svc, "bob", checkpoint=False, **one)
        svc.service.start()
        with svc.client() as admin:
            deadline = time.time() + 60
            while len(running := admin.get("/v1/jobs", params={"status": "running"}).json()["data"]) < 2:
                assert time.time() < deadline, running
                time.sleep(0.1)
            time.sleep(5 * svc.service.scheduler.poll_s)  # a few more passes of the scheduler
            assert {j["id"] for j in admin.get("/v1/jobs", params={"status": "running"}).json()["data"]} == {
                a[0],
                b,
            }
            assert (
                admin.get(f"/v1/jobs/{a[1]}").json()["status"] == "queued"
            )  # 7 CPUs free: the quota holds it
            assert admin.get("/v1/usage", params={"owner": "alice"}).json()["data"][0]["running_jobs"] == 1
            for job_id in (*a, b):
                admin.post(f"/v1/jobs/{job_id}/cancel")
            for job_id in (*a, b):
                wait_for(admin, job_id, ("cancelled",), timeout_s=60)
    finally:
        svc.stop()
