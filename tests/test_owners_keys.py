"""API keys with owners: made by the admin over the API and the CLI, shown once, listed without the
key, sent as a bearer token or as X-API-Key (the tinker SDK's header), refused at once when revoked
or expired (on the hot read path too), and every key change in the audit log.

The service runs without its scheduler (no Ray): nothing here needs a job to run.
"""

from __future__ import annotations

import os
import stat
import time

import httpx
import pytest

from api.cli import main
from tests.owners_util import as_key, make_key, owned_job


@pytest.fixture
def admin(unscheduled):
    with unscheduled.client() as http:
        yield http


def test_a_key_is_shown_once_and_works_as_a_bearer_token_or_x_api_key(unscheduled, admin):
    made = make_key(admin, "alice", scope="write", name="laptop")
    assert made["key"].startswith("tml-") and made["owner"] == "alice" and made["scopes"] == ["read", "write"]
    for header in ("bearer", "x-api-key"):
        with as_key(unscheduled, made["key"], header) as alice:
            assert alice.get("/v1/jobs").status_code == 200, header
            refused = alice.get("/v1/keys")  # keys are the admin's business
            assert refused.status_code == 403 and refused.json()["error"]["code"] == "insufficient_scope"
    listed = admin.get("/v1/keys", params={"owner": "alice"}).json()["data"]
    mine = next(k for k in listed if k["id"] == made["id"])
    assert mine["state"] == "active" and mine["last_used_at"] is not None and mine["name"] == "laptop"
    assert made["key"] not in str(listed) and "hash" not in mine and "key" not in mine
    reader = make_key(admin, "alice", scope="read")
    with as_key(unscheduled, reader["key"]) as alice_reads:
        assert alice_reads.get("/v1/jobs").status_code == 200
        assert alice_reads.post("/v1/jobs/job-000000000000/cancel").status_code == 403


def test_a_revoked_key_is_refused_at_once_on_every_path(unscheduled, admin):
    made = make_key(admin, "carol")
    with as_key(unscheduled, made["key"]) as carol:
        for _ in range(2):  # the second is answered before FastAPI (api/read_cache.py)
            assert carol.get("/v1/jobs", params={"limit": 7}).status_code == 200
        assert admin.delete(f"/v1/keys/{made['id']}").json()["state"] == "revoked"
        for url in ("/v1/jobs?limit=7", "/v1/files", "/v1/usage"):
            refused = carol.get(url)
            assert (refused.status_code, refused.json()["error"]["code"]) == (401, "invalid_token"), url
    again = admin.delete(f"/v1/keys/{made['id']}")
    assert again.status_code == 200 and again.json()["revoked_at"] == pytest.approx(time.time(), abs=60)
    assert admin.delete("/v1/keys/key-000000000000").status_code == 404
    admin_key = next(k for k in admin.get("/v1/keys").json()["data"] if k["admin"])
    assert admin.delete(f"/v1/keys/{admin_key['id']}").status_code == 409  # the admin cannot lock itself out


def test_a_stream_open_on_a_key_ends_soon_after_the_key_is_revoked(unscheduled, admin):
    """A queued job's streams would stay open for ever: revoking the key that opened one must end it."""
    job = owned_job(unscheduled, "grace", checkpoint=False)
    for kind in ("logs", "events", "metrics"):
        made = make_key(admin, "grace")
        headers = {"Authorization": f"Bearer {made['key']}"}
        url = f"{unscheduled.url}/v1/jobs/{job}/{kind}/stream"
        with httpx.stream("GET", url, headers=headers, timeout=httpx.Timeout(30, read=8)) as stream:
            assert stream.status_code == 200, kind
            lines = stream.iter_lines()
            assert next(lines).startswith("id: "), kind  # the job's row: the stream is live
            assert admin.delete(f"/v1/keys/{made['id']}").status_code == 200
            revoked_at = time.monotonic()
            try:
                rest = list(lines)
            except httpx.ReadTimeout:
                pytest.fail(f"the {kind} stream of a revoked key was still open 8 s after its revocation")
            assert time.monotonic() - revoked_at < 5 and not any(line.startswith("id: ") for line in rest)
        again = httpx.get(url, headers=headers, timeout=30)  # the client's reconnect is refused
        assert (again.status_code, again.json()["error"]["code"]) == (401, "invalid_token"), kind


def test_an_expired_key_is_refused_from_the_moment_it_expires(unscheduled, admin):
    made = make_key(admin, "dave", expires_days=2 / 86_400)  # two seconds
    with as_key(unscheduled, made["key"]) as dave:
        for _ in range(2):
            assert dave.get("/v1/jobs", params={"limit": 9}).status_code == 200
        time.sleep(max(0.0, made["expires_at"] - time.time()) + 0.05)
        assert dave.get("/v1/jobs", params={"limit": 9}).status_code == 401  # the learned hot query too
        assert dave.get("/v1/jobs").status_code == 401
    listed = admin.get("/v1/keys", params={"owner": "dave"}).json()["data"]
    assert [k["state"] for k in listed] == ["expired"]


def test_bad_key_requests_name_the_field(admin):
    for body, param in (({"owner": "no spaces"}, "owner"), ({"owner": "x", "scope": "all"}, "scope"),
                        ({"owner": "x", "expires_days": 0}, "expires_days"), ({}, "owner")):  # fmt: skip
        refused = admin.post("/v1/keys", json=body)
        assert (refused.status_code, refused.json()["error"]["param"]) == (422, param), body


def test_the_cli_prints_the_key_alone_on_its_last_line_and_never_lists_it(unscheduled, capsys):
    conn = ["--url", unscheduled.url, "--token", unscheduled.token]
    assert main(["keys", "create", "--owner", "erin", "--scope", "read", "--expires", "30", *conn]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    key = lines[-1]
    assert key.startswith("tml-") and " " not in key and all(key not in line for line in lines[:-1])
    with as_key(unscheduled, key) as erin:
        assert erin.get("/v1/jobs").status_code == 200
    assert main(["keys", "list", *conn]) == 0
    listing = capsys.readouterr().out
    assert "erin" in listing and key not in listing and "read" in listing
    key_id = next(line.split()[0] for line in listing.splitlines() if " erin " in line)
    assert main(["keys", "revoke", key_id, *conn]) == 0
    assert "revoked" in capsys.readouterr().out
    with as_key(unscheduled, key) as erin:
        assert erin.get("/v1/jobs").status_code == 401
    assert main(["keys", "list", "--token", key, "--url", unscheduled.url]) != 0  # not the admin's


def test_a_read_only_admin_key_reads_keys_but_cannot_make_one(unscheduled, admin):
    from api.auth import hash_token, new_key

    token = new_key()
    unscheduled.service.store.add_token("old reader", hash_token(token), ["read"], "admin", admin=True)
    with as_key(unscheduled, token) as reader:
        assert reader.get("/v1/keys").status_code == 200
        refused = reader.post("/v1/keys", json={"owner": "mallory"})
        assert (refused.status_code, refused.json()["error"]["code"]) == (403, "insufficient_scope")
    assert admin.post("/v1/keys", json={"owner": "default"}).json()["error"]["param"] == "owner"  # reserved


def test_key_changes_are_in_the_audit_log_with_the_request_id(unscheduled, admin):
    made = admin.post("/v1/keys", json={"owner": "frank"}, headers={"x-request-id": "req-audit-key"})
    revoked = admin.delete(f"/v1/keys/{made.json()['id']}", headers={"x-request-id": "req-audit-revoke"})
    assert revoked.status_code == 200
    entries = admin.get("/v1/audit", params={"target": made.json()["id"]}).json()["data"]
    assert [(e["action"], e["request_id"], e["target_owner"]) for e in entries] == [
        ("revoke_key", "req-audit-revoke", "frank"),
        ("create_key", "req-audit-key", "frank"),
    ]
    admin_key = next(k for k in admin.get("/v1/keys").json()["data"] if k["admin"])
    assert {e["key_id"] for e in entries} == {admin_key["id"]} and {e["owner"] for e in entries} == {"admin"}
    assert made.json()["key"] not in str(admin.get("/v1/audit").json())


def test_a_store_made_before_owners_gives_its_rows_and_keys_to_the_admin(tmp_path):
    """Open a database with the tables as they were before owners (no owner columns): its jobs are
    the admin's, and its keys keep seeing everything, but a read-only one cannot write keys."""
    import json
    import sqlite3

    from api.auth import hash_token
    from service.store import JobStore
    from service.store_schema import SCHEMA

    path = tmp_path / "tandem.db"
    with sqlite3.connect(path) as db:
        db.executescript(SCHEMA)  # jobs and keys as the first schema had them
        db.execute("INSERT INTO jobs (id, seq, status, method, spec, created_at, total_steps, workdir) "
                   "VALUES ('job-000000000001', 1, 'succeeded', 'grpo', '{}', 1.0, 3, '/tmp/x')")  # fmt: skip
        db.execute(
            "INSERT INTO tokens VALUES ('tok-1', 'reader', ?, ?, 1.0)",
            (hash_token("old"), json.dumps(["read"])),
        )
    store = JobStore(path)
    assert store.get_job("job-000000000001").owner == "admin"
    (old,) = store.tokens()
    assert (old["owner"], old["admin"], old["expires_at"], old["revoked_at"]) == ("admin", True, None, None)


def test_the_admin_token_file_is_the_owners_alone_and_a_stale_one_is_replaced(tmp_path, monkeypatch):
    from api.auth import ensure_admin_token, hash_token
    from service.store import JobStore

    monkeypatch.delenv("TANDEM_ADMIN_TOKEN", raising=False)
    store = JobStore(tmp_path / "t.db")
    stale = tmp_path / "home" / "admin_token"
    stale.parent.mkdir()
    stale.write_text("tml-not-a-registered-key\n")
    stale.chmod(0o644)
    previous = os.umask(0)  # the most open umask: the file's mode must not come from it
    try:
        path = ensure_admin_token(store, tmp_path / "home")
    finally:
        os.umask(previous)
    token = path.read_text().strip()
    assert path == stale and stat.S_IMODE(path.stat().st_mode) == 0o600
    assert hash_token(token) in {t["hash"] for t in store.tokens()}
    assert [p.name for p in path.parent.iterdir()] == ["admin_token"]  # no part file left
    assert ensure_admin_token(store, tmp_path / "home").read_text().strip() == token  # kept once registered


def test_a_new_admin_token_revokes_the_one_it_replaces(tmp_path, monkeypatch):
    """The one way to rotate a stolen admin token (the API refuses to revoke it): set a new
    TANDEM_ADMIN_TOKEN, or delete the file, and restart. The old token must stop working."""
    from api.auth import ensure_admin_token, hash_token
    from service.store import JobStore

    def valid(token: str) -> bool:
        return any(t["hash"] == hash_token(token) and t["revoked_at"] is None for t in store.tokens())

    monkeypatch.delenv("TANDEM_ADMIN_TOKEN", raising=False)
    store, home = JobStore(tmp_path / "t.db"), tmp_path / "home"
    first = ensure_admin_token(store, home).read_text().strip()
    monkeypatch.setenv("TANDEM_ADMIN_TOKEN", "tml-rotated-by-the-operator")
    ensure_admin_token(store, home)
    assert valid("tml-rotated-by-the-operator") and not valid(first)
    monkeypatch.setenv("TANDEM_ADMIN_TOKEN", "tml-rotated-again")
    ensure_admin_token(store, home)
    assert valid("tml-rotated-again") and not valid("tml-rotated-by-the-operator")
    monkeypatch.delenv("TANDEM_ADMIN_TOKEN")  # back to the file, whose token was replaced: a new one
    fresh = ensure_admin_token(store, home).read_text().strip()
    assert fresh != first and valid(fresh) and not valid("tml-rotated-again") and not valid(first)
    (home / "admin_token").unlink()  # the file's token leaked: delete it and restart
    newest = ensure_admin_token(store, home).read_text().strip()
    assert valid(newest) and not valid(fresh)
    monkeypatch.setenv("TANDEM_ADMIN_TOKEN", "tml-rotated-again")  # a revoked token stays revoked
    with pytest.raises(ValueError, match="TANDEM_ADMIN_TOKEN"):
        ensure_admin_token(store, home)
    assert valid(newest)
