"""An owner trying to get past its quotas or the cluster's shape: a job that could never be placed or
never be let run is refused at submission, and the checkpoint copy a fork keeps counts against the
forking owner's stored bytes even once the parent is deleted. The service runs without its scheduler."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.api_util import tiny_job
from tests.owners_util import as_key, make_key, owned_job

ONE_CPU = {"resources": {"workers": 1, "cpus_per_worker": 1}}


@pytest.fixture(scope="module")
def admin(unscheduled, ray_cluster):  # the cluster's shape (one node here) comes from Ray
    with unscheduled.client() as client:
        yield client


def owner(unscheduled, admin, name: str, **quota):
    assert admin.put(f"/v1/quotas/{name}", json=quota).status_code == 200
    return as_key(unscheduled, make_key(admin, name)["key"])


def test_a_strict_spread_job_with_more_workers_than_nodes_is_a_422_naming_the_strategy(unscheduled, admin):
    """One worker per node on a one-node cluster could never be placed: refused now, not failed later."""
    spread = owner(unscheduled, admin, "spreader")
    spec = tiny_job(resources={"workers": 2, "cpus_per_worker": 1, "placement_strategy": "STRICT_SPREAD"})
    for path in ("/v1/jobs", "/v1/jobs/validate"):
        answer = spread.post(path, json=spec)
        assert answer.status_code == 422, answer.text
        error = answer.json()["error"]
        assert (error["param"], error["code"]) == ("resources.placement_strategy", "insufficient_resources")
        assert "2 training workers" in error["message"] and "1 node(s) of 1 can hold one" in error["message"]
    assert unscheduled.service.store.jobs_of("spreader") == []
    one = tiny_job(resources={"workers": 1, "cpus_per_worker": 1, "placement_strategy": "STRICT_SPREAD"})
    assert spread.post("/v1/jobs", json=one).status_code == 201  # one worker fits one node


def test_a_running_jobs_quota_of_0_refuses_submissions_instead_of_queueing_them_forever(unscheduled, admin):
    never = owner(unscheduled, admin, "never-runs", running_jobs=0)
    answer = never.post("/v1/jobs", json=tiny_job(**ONE_CPU))
    assert answer.status_code == 403, answer.text
    error = answer.json()["error"]
    assert (error["param"], error["code"]) == ("quota.running_jobs", "quota_exceeded")
    assert "allows none" in error["message"] and "retry-after" not in answer.headers
    assert unscheduled.service.store.jobs_of("never-runs") == []


def test_a_forks_checkpoint_copy_counts_against_stored_bytes_after_its_parent_is_deleted(unscheduled, admin):
    forker = owner(unscheduled, admin, "forker")
    parent = owned_job(unscheduled, "forker", **ONE_CPU)
    weights = Path(unscheduled.service.store.checkpoints(parent)[0]["path"], "weights.bin")
    weights.write_bytes(b"w" * 50_000)
    child = forker.post(f"/v1/jobs/{parent}/fork", json={})
    assert child.status_code == 201, child.text
    before = forker.get("/v1/usage").json()["data"][0]["stored_bytes"]["checkpoints"]
    assert 50_000 <= before < 100_000  # the copy is hard links to the parent's files: counted once
    assert forker.post(f"/v1/jobs/{parent}/cancel").status_code == 200
    assert forker.delete(f"/v1/jobs/{parent}").status_code == 200
    used = forker.get("/v1/usage").json()["data"][0]["stored_bytes"]
    assert used["checkpoints"] >= 50_000  # the copy the child resumes from is still on disk
    assert admin.put("/v1/quotas/forker", json={"stored_bytes": 50_000}).status_code == 200
    refused = forker.post("/v1/jobs", json=tiny_job(**ONE_CPU))
    assert refused.status_code == 403 and refused.json()["error"]["param"] == "quota.stored_bytes"
