"""Jobs belong to the key that submits or forks them: against a real service on the tests' Ray (its
scheduler not started, so jobs stay queued), submit, Idempotency-Key and fork as two owners."""

from __future__ import annotations

import pytest

from tests.api_util import start_service, tiny_job
from tests.owners_util import as_key, make_key, owned_job


@pytest.fixture(scope="module")
def shared(ray_cluster, tmp_path_factory):
    svc = start_service(tmp_path_factory.mktemp("owners-jobs"), schedule=False)
    with svc.client() as admin:
        alice = as_key(svc, make_key(admin, "alice")["key"])
        bob = as_key(svc, make_key(admin, "bob")["key"])
        yield svc, admin, alice, bob
        alice.close()
        bob.close()
    svc.stop()


def test_a_submitted_job_is_its_submitters_and_idempotency_keys_are_per_owner(shared):
    svc, admin, alice, bob = shared
    spec = tiny_job(metadata={"suite": "owners"})
    first = alice.post("/v1/jobs", json=spec, headers={"Idempotency-Key": "same-key"})
    assert first.status_code == 201 and first.json()["owner"] == "alice", first.text
    again = alice.post("/v1/jobs", json=spec, headers={"Idempotency-Key": "same-key"})
    assert (again.status_code, again.json()["id"]) == (200, first.json()["id"])
    bobs = bob.post("/v1/jobs", json=spec, headers={"Idempotency-Key": "same-key"})
    assert bobs.status_code == 201 and bobs.json()["id"] != first.json()["id"] and bobs.json()["owner"] == "bob"
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
    by_admin = admin.post(f"/v1/jobs/{parent}/fork", json={"overrides": {"trainer": {"total_steps": 5}}}).json()
    assert by_admin["owner"] == "admin" and alice.get(f"/v1/jobs/{by_admin['id']}").status_code == 404
    assert {j["id"] for j in bob.get("/v1/jobs").json()["data"]}.isdisjoint({parent, mine.json()["id"]})
