"""An owner trying to get past its quotas or the cluster's shape: a job that could never be placed or
never be let run is refused at submission, and the checkpoint copy a fork keeps counts against the
forking owner's stored bytes even once the parent is deleted. The service runs without its scheduler."""

from __future__ import annotations

import json
import socket
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


def test_an_upload_streamed_past_the_stored_bytes_quota_is_refused_before_its_body_ends(unscheduled, admin):
    """A chunked body is refused once it passes the owner's room, while the client still sends: the
    service never writes more than the quota allows plus a chunk to disk."""
    key = make_key(admin, "streamer")["key"]
    assert admin.put("/v1/quotas/streamer", json={"stored_bytes": 1000}).status_code == 200
    host, port = unscheduled.url.removeprefix("http://").split(":")
    chunk = b'{"p": "' + b"x" * 4000 + b'"}\n'
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(
            f"POST /v1/files?filename=big.jsonl HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {key}\r\n"
            "Content-Type: application/octet-stream\r\nTransfer-Encoding: chunked\r\n\r\n".encode()
            + f"{len(chunk):x}\r\n".encode()
            + chunk
            + b"\r\n"
        )  # and never the last chunk: the answer must not wait for it
        answer = b""
        while b"\r\n\r\n" not in answer or not answer.rstrip().endswith(b"}"):
            got = sock.recv(65536)  # the socket's timeout bounds the wait
            assert got, answer
            answer += got
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 403"), answer
    assert json.loads(body)["error"]["param"] == "quota.stored_bytes"
    assert unscheduled.service.files.records("streamer") == []
