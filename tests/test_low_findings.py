"""Smaller ways one owner could reach another's work or the admin's, or write what it likes into the
service's records, each tried against a real service (uvicorn, SQLite, the tests' Ray; its scheduler
not started, so jobs stay queued): Idempotency-Keys per owner, reserved owner names, bounded
x-request-id and Idempotency-Key headers, `/v1/cluster` per owner, and the metadata filter."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from service.store import JobStore
from tests.api_util import start_service, tiny_job
from tests.owners_util import admin_and_owners, owned_job

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def shared(ray_cluster, tmp_path_factory):
    svc = start_service(tmp_path_factory.mktemp("low-findings"), schedule=False)
    with admin_and_owners(svc, "alice-x", "bob") as (admin, alice, bob):
        yield svc, admin, alice, bob
    svc.stop()


# ---- Idempotency-Key ------------------------------------------------------------------------------


def test_an_admins_idempotency_key_never_names_another_owners_job(shared):
    """The admin's `alice-x/K` is the admin's key, not alice-x's `K` (once stored as the same string)."""
    svc, admin, alice, _ = shared
    spec = tiny_job(metadata={"suite": "idem-owner"})
    hers = alice.post("/v1/jobs", json=spec, headers={"Idempotency-Key": "K"})
    assert hers.status_code == 201, hers.text
    mine = admin.post("/v1/jobs", json=spec, headers={"Idempotency-Key": "alice-x/K"})
    assert mine.status_code == 201 and mine.json()["owner"] == "admin", mine.text
    assert mine.json()["id"] != hers.json()["id"]
    again = admin.post("/v1/jobs", json=spec, headers={"Idempotency-Key": "alice-x/K"})
    assert (again.status_code, again.json()["id"]) == (200, mine.json()["id"])
    hers_again = alice.post("/v1/jobs", json=spec, headers={"Idempotency-Key": "K"})
    assert (hers_again.status_code, hers_again.json()["id"]) == (200, hers.json()["id"])


def test_an_idempotency_key_longer_than_255_characters_is_refused(shared):
    _, admin, _, _ = shared
    spec = tiny_job(metadata={"suite": "idem-long"})
    refused = admin.post("/v1/jobs", json=spec, headers={"Idempotency-Key": "k" * 256})
    assert refused.status_code == 422, refused.text
    assert refused.json()["error"]["param"] == "Idempotency-Key"
    assert admin.post("/v1/jobs", json=spec, headers={"Idempotency-Key": "k" * 255}).status_code == 201


# The jobs table as stores made before per-owner keys had it: one globally unique idempotency_key
# holding an owner's key as "owner/key" and the admin's as sent.
OLD_JOBS = """
CREATE TABLE jobs (
    id TEXT PRIMARY KEY, seq INTEGER NOT NULL, status TEXT NOT NULL, method TEXT NOT NULL, spec TEXT NOT NULL,
    metadata TEXT NOT NULL DEFAULT '{}', created_at REAL NOT NULL, started_at REAL, finished_at REAL,
    step INTEGER NOT NULL DEFAULT 0, total_steps INTEGER NOT NULL, latest_metrics TEXT NOT NULL DEFAULT '{}',
    error TEXT, parent_id TEXT, workdir TEXT NOT NULL, idempotency_key TEXT UNIQUE, request_hash TEXT,
    stop_reason TEXT, owner TEXT NOT NULL DEFAULT 'admin'
);
"""


def test_an_older_stores_idempotency_keys_still_return_their_jobs(tmp_path):
    path = tmp_path / "tandem.db"
    with sqlite3.connect(path) as db:
        db.executescript(OLD_JOBS)
        for seq, (owner, stored) in enumerate([("alice", "alice/K1"), ("admin", "K2"), ("admin", "bob/K3")]):
            db.execute("INSERT INTO jobs (id, seq, status, method, spec, created_at, total_steps, workdir, "
                       "idempotency_key, request_hash, owner) VALUES (?, ?, 'queued', 'grpo', '{}', 1.0, 3, "
                       "'/tmp/x', ?, 'h', ?)", (f"job-{seq}", seq + 1, stored, owner))  # fmt: skip
    store = JobStore(path)
    assert store.job_by_idempotency_key("alice", "K1").id == "job-0"
    assert store.job_by_idempotency_key("admin", "K2").id == "job-1"
    assert store.job_by_idempotency_key("admin", "bob/K3").id == "job-2"  # the admin's, as sent
    assert store.job_by_idempotency_key("bob", "K3") is None
    assert store.job_by_idempotency_key("admin", "alice/K1") is None
    JobStore(path)  # opened again: nothing to migrate twice
    assert store.job_by_idempotency_key("alice", "K1").id == "job-0"


# ---- reserved owner names ---------------------------------------------------------------------------


@pytest.mark.parametrize("owner", ["admin", "Admin", "default"])
def test_no_key_is_made_for_a_reserved_owner_name(shared, owner):
    _, admin, _, _ = shared
    refused = admin.post("/v1/keys", json={"owner": owner})
    assert refused.status_code == 422, refused.text
    error = refused.json()["error"]
    assert error["param"] == "owner" and "reserved" in error["message"]
    assert owner not in {k["owner"] for k in admin.get("/v1/keys").json()["data"] if not k["admin"]}


def test_the_cli_refuses_a_key_for_the_admin_owner(shared):
    svc, *_ = shared
    env = {**os.environ, "TANDEM_URL": svc.url, "TANDEM_TOKEN": svc.token, "TANDEM_HOME": "/nonexistent"}
    made = subprocess.run([sys.executable, "-m", "api.cli", "keys", "create", "--owner", "admin"], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert made.returncode != 0 and "reserved" in made.stderr and "owner" in made.stderr, made
    assert "tml-" not in made.stdout


# ---- x-request-id ----------------------------------------------------------------------------------


def test_a_huge_or_odd_request_id_is_replaced_and_a_sane_one_kept(shared):
    _, admin, _, _ = shared
    for given in ("r" * 6004, "two words", "<script>"):
        made = admin.post("/v1/keys", json={"owner": "carol"}, headers={"x-request-id": given})
        assert made.status_code == 201, made.text
        rid = made.headers["x-request-id"]
        assert rid != given and rid.startswith("req_") and len(rid) <= 128
        (entry,) = admin.get("/v1/audit", params={"target": made.json()["id"]}).json()["data"]
        assert entry["request_id"] == rid
    kept = admin.get("/v1/jobs", headers={"x-request-id": "trace-01HZ:abc/def=="})
    assert kept.headers["x-request-id"] == "trace-01HZ:abc/def=="


# ---- /v1/cluster --------------------------------------------------------------------------------------


def test_the_cluster_shows_an_owner_its_own_jobs_and_no_node_addresses(shared):
    svc, admin, alice, bob = shared
    owned_job(svc, "bob", checkpoint=False)
    owned_job(svc, "bob", checkpoint=False)
    theirs = bob.get("/v1/cluster").json()
    everyone = admin.get("/v1/cluster").json()
    bobs = svc.service.store.counts_by_status("bob").get("queued", 0)
    assert theirs["jobs"] == {"running": 0, "queued": bobs} and bobs >= 2
    assert everyone["jobs"]["queued"] == svc.service.store.counts_by_status().get("queued", 0) > bobs
    assert alice.get("/v1/cluster").json()["jobs"]["queued"] != everyone["jobs"]["queued"]
    assert everyone["nodes"] and all(n["address"] for n in everyone["nodes"])
    assert all("address" not in n for n in theirs["nodes"])
    address = everyone["nodes"][0]["address"]
    assert address not in json.dumps(theirs)
    assert theirs["cpus"]["total"] == everyone["cpus"]["total"] > 0  # the capacity is everyone's


# ---- the metadata filter ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "item",
    [":x", "a'b:x", "$.x:1", 'a"]:1', "a b:c", "k" * 65 + ":v", "k:" + "v" * 513],
)
def test_a_metadata_filter_no_job_could_match_is_a_422_naming_metadata(shared, item):
    _, admin, alice, _ = shared
    for client in (admin, alice):
        listed = client.get("/v1/jobs", params={"metadata": item})
        assert listed.status_code == 422, (item, listed.text)
        assert listed.json()["error"]["param"] == "metadata"


def test_more_metadata_filters_than_a_job_has_keys_are_refused(shared):
    _, admin, _, _ = shared
    listed = admin.get("/v1/jobs", params=[("metadata", f"k{i}:v") for i in range(17)])
    assert listed.status_code == 422 and listed.json()["error"]["param"] == "metadata", listed.text


def test_metadata_keys_with_dots_slashes_and_dashes_are_filtered_exactly(shared):
    """A key is matched as a whole, never read as a JSON path (`a.b` is not `{"a": {"b": ...}}`)."""
    _, admin, _, _ = shared
    made = admin.post("/v1/jobs", json=tiny_job(metadata={"team.name/x-1": "v", "a": "1"}))
    assert made.status_code == 201, made.text
    found = admin.get("/v1/jobs", params=[("metadata", "team.name/x-1:v"), ("metadata", "a:1")]).json()
    assert [j["id"] for j in found["data"]] == [made.json()["id"]]
    nested = admin.post("/v1/jobs", json=tiny_job(metadata={"team": '{"name": "v"}'}))
    assert nested.status_code == 201
    assert admin.get("/v1/jobs", params={"metadata": "team.name:v"}).json()["data"] == []


def test_a_metadata_key_a_filter_could_not_name_is_refused_at_submission(shared):
    _, admin, _, _ = shared
    for key in ("", "a:b", "has space", ".hidden"):
        refused = admin.post("/v1/jobs", json=tiny_job(metadata={key: "v"}))
        assert refused.status_code == 422, (key, refused.text)
        assert refused.json()["error"]["param"].startswith("metadata"), refused.text


# ---- samples without a reward (a Tinker sampler's) ---------------------------------------------------


def test_the_cli_prints_a_sample_without_reward_by_its_sampler():
    from api.cli_jobs import format_sample

    tinker = {"step": 3, "index": 0, "prompt": "1 2", "sampler": "smp-1", "finish_reason": None,
              "turns": [{"role": "assistant", "content": "3"}], "tokens": {"prompt": 2, "response": 1}}  # fmt: skip
    head, *lines = format_sample(tinker).splitlines()
    assert "sampler smp-1" in head and "1 response tokens" in head and "reward" not in head, head
    assert lines == ["[prompt] 1 2", "[assistant] 3"]
    rl = {**tinker, "reward": 1.0, "finish_reason": "stop", "tokens": {"response": 4, "trained": 3}}
    del rl["sampler"]
    assert "reward 1 · stop · 3/4 response tokens trained" in format_sample(rl)
