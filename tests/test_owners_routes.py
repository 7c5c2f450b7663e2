"""Two owners on one service see only their own work, on every route: the test walks the service's
OpenAPI document, so a route added later without the owner check fails it.

For every operation with a path parameter, bob's request for alice's resource is a 404 in the API's
error shape (never a 403: existence is not revealed) and changes nothing, while alice's own request
is not a 404; admin-only operations are a 403 for both. Every operation without one must be listed
in UNSCOPED with how it keeps owners apart (and the list routes are checked here: bob's lists,
searches and filters never hold alice's work). Every write either owner makes is in the audit log.
The service runs without Ray (jobs stay queued); `tests/owners_util.py` puts work in its store.
"""

from __future__ import annotations

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from api.deps import TokenScope
from tests.owners_util import make_key, owned_job, two_owners, upload

# operations without a path parameter, and what keeps owners apart on each
UNSCOPED = {
    ("GET", "/healthz"): "open probe: no data",
    ("GET", "/readyz"): "open probe: no data",
    ("GET", "/v1/version"): "service facts: no owner's data",
    ("GET", "/v1/cluster"): "capacity for all; job counts of the caller's own (tests/test_low_findings.py)",
    ("POST", "/v1/jobs"): "creates a job of the caller's (tests/test_owners_jobs.py)",
    (
        "GET",
        "/v1/jobs",
    ): "list: the caller's own (test_lists_searches_and_filters_hold_only_the_callers_work)",
    ("POST", "/v1/jobs/validate"): "checks a spec; its uploads and paths must be the caller's",
    ("POST", "/v1/rewards/validate"): "checks a function; an upload it names must be the caller's",
    ("POST", "/v1/files"): "creates a file of the caller's",
    ("GET", "/v1/files"): "list: the caller's own",
    ("GET", "/v1/usage"): "list: the caller's own usage (tests/test_owners_quotas.py)",
    ("GET", "/v1/keys"): "admin only",
    ("POST", "/v1/keys"): "admin only",
    ("GET", "/v1/audit"): "admin only",
    ("GET", "/v1/quotas"): "admin only",
    ("GET", "/v1/service"): "admin only: the API process's pid, memory and loaded modules",
}
# a valid body for operations that require one: a body FastAPI refuses would hide the owner check
BODIES = {
    ("PATCH", "/v1/jobs/{job_id}"): {"name": "renamed"},
    ("PATCH", "/v1/jobs/{job_id}/hyperparameters"): {"lr": 1e-4},
    ("POST", "/v1/jobs/{job_id}/fork"): {},
    ("PUT", "/v1/quotas/{owner}"): {"running_jobs": 3},
    ("POST", "/v1/jobs/{job_id}/openai/v1/chat/completions"): {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
    },
    ("POST", "/v1/jobs/{job_id}/openai/v1/completions"): {"model": "m", "prompt": "hi"},
    ("POST", "/v1/jobs/{job_id}/openai/trajectories/{trajectory_id}/v1/chat/completions"): {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
    },
    ("POST", "/v1/jobs/{job_id}/openai/trajectories/{trajectory_id}/v1/completions"): {
        "model": "m",
        "prompt": "hi",
    },
    ("POST", "/v1/jobs/{job_id}/openai/v1/responses"): {"model": "m", "input": "hi"},
    ("POST", "/v1/jobs/{job_id}/openai/trajectories/{trajectory_id}/v1/responses"): {
        "model": "m",
        "input": "hi",
    },
    ("POST", "/v1/jobs/{job_id}/trajectories/{trajectory_id}/reward"): {"reward": 1.0},
}


@pytest.fixture(scope="module")
def owners(unscheduled):
    with two_owners(unscheduled) as clients:
        yield clients


def operations(app) -> list[tuple[str, str, str | None]]:
    """(method, path, scope) of every operation in the OpenAPI document; scope is the route's
    TokenScope ('read', 'write', 'admin'), None for an open route."""
    scopes = {}
    for route in app.routes:
        for method in getattr(route, "methods", ()) if hasattr(route, "dependant") else ():
            found = [d.call.scope for d in route.dependant.dependencies if isinstance(d.call, TokenScope)]
            scopes[(method, route.path)] = found[0] if found else None
    return [
        (m.upper(), path, scopes[(m.upper(), path)])
        for path, ops in app.openapi()["paths"].items()
        for m in ops
    ]


def call(client: httpx.Client, method: str, url: str, body, request_id: str = "") -> tuple[int, dict | None]:
    """Status and JSON body; a live stream is not read, only opened."""
    headers = {"x-request-id": request_id} if request_id else None
    with client.stream(method, url, json=body, headers=headers, timeout=30) as response:
        if response.headers.get("content-type", "").startswith("text/event-stream"):
            return response.status_code, None
        response.read()
        is_json = response.headers.get("content-type", "").startswith("application/json")
        return response.status_code, response.json() if is_json else None


def alices_things(svc, alice, path: str, key_id: str) -> dict[str, str]:
    """Fresh resources of alice's for one operation (the last may have deleted them): the path
    parameters' values."""
    file_id = upload(alice)["id"] if "{file_id}" in path else "file-000000000000"
    return {"job_id": owned_job(svc, "alice", checkpoint=False), "file_id": file_id, "key_id": key_id,
            "owner": "alice", "trajectory_id": "traj-1"}  # fmt: skip


def test_every_operation_with_a_path_parameter_is_a_404_for_another_owner(unscheduled, owners):
    admin, alice, bob = owners
    app = unscheduled.server.config.app
    walked = audited = 0
    key_id = make_key(admin, "alice", scope="read")["id"]
    for method, path, scope in operations(app):
        if "{" not in path:
            assert (method, path) in UNSCOPED, f"{method} {path}: a new route without a path parameter; say in " \
                "UNSCOPED how it keeps owners apart, and test it"  # fmt: skip
            continue
        things = alices_things(unscheduled, alice, path, key_id)
        url = path.format(**things)
        body = BODIES.get((method, path))
        before = (
            unscheduled.service.store.get_job(things["job_id"]),
            unscheduled.service.files.records("alice"),
        )
        status, error = call(bob, method, url, body)
        if scope == "admin":
            assert status == 403, f"{method} {path}: admin only, yet bob got {status}"
            assert call(alice, method, url, body)[0] == 403
            continue
        assert status == 404, f"{method} {path}: bob reached alice's resource ({status}: {error})"
        assert error is not None and error["error"]["code"] == "not_found", f"{method} {path}: {error}"
        assert error["error"]["param"] in things, f"{method} {path}: {error}"
        after = (
            unscheduled.service.store.get_job(things["job_id"]),
            unscheduled.service.files.records("alice"),
        )
        assert after == before, f"{method} {path}: bob's refused request changed alice's work"
        rid = f"req-walk-{walked}"
        status, error = call(alice, method, url, body, rid)
        assert status < 500 and not (status == 404 and error["error"]["param"] in things), (
            f"{method} {path}: alice could not reach her own resource ({status}: {error})"
        )
        if method != "GET" and status < 300:  # an accepted write is in the audit log
            entries = admin.get("/v1/audit", params={"owner": "alice", "limit": 5}).json()["data"]
            assert [e["request_id"] for e in entries][:1] == [rid], f"{method} {path}: not audited"
            audited += 1
        walked += 1
    assert walked >= 20 and audited >= 4


def test_lists_searches_and_filters_hold_only_the_callers_work(unscheduled, owners):
    admin, alice, bob = owners
    a_job, b_job = owned_job(unscheduled, "alice"), owned_job(unscheduled, "bob")
    a_file, b_file = upload(alice)["id"], upload(bob)["id"]

    def ids(client: httpx.Client, url: str, **params) -> set[str]:
        response = client.get(url, params={"limit": 100, **params})
        assert response.status_code == 200, response.text
        return {row["id"] for row in response.json()["data"]}

    for client, mine, theirs in ((alice, a_job, b_job), (bob, b_job, a_job)):
        for _ in range(2):  # the second is answered before FastAPI (api/read_cache.py)
            assert mine in ids(client, "/v1/jobs") and theirs not in ids(client, "/v1/jobs")
        assert ids(client, "/v1/jobs", q=theirs) == set() and ids(client, "/v1/jobs", q=mine) == {mine}
        assert theirs not in ids(client, "/v1/jobs", owner="alice") | ids(client, "/v1/jobs", owner="bob")
    refused = bob.get("/v1/jobs", params={"after": a_job})  # another owner's job is no cursor
    assert refused.status_code == 404 and refused.json()["error"]["param"] == "after"
    assert (a_file in ids(alice, "/v1/files"), a_file in ids(bob, "/v1/files")) == (True, False)
    assert b_file not in ids(alice, "/v1/files", owner="bob")
    everyone = ids(admin, "/v1/jobs")
    assert {a_job, b_job} <= everyone
    assert a_job in ids(admin, "/v1/jobs", owner="alice") and b_job not in ids(
        admin, "/v1/jobs", owner="alice"
    )
    assert ids(admin, "/v1/files", owner="bob") >= {b_file} and a_file not in ids(
        admin, "/v1/files", owner="bob"
    )
    shown = alice.get(f"/v1/jobs/{a_job}").json()
    assert shown["owner"] == "alice" and alice.get("/v1/jobs").json()["data"][0]["owner"] == "alice"


def test_a_metrics_page_read_for_one_owner_is_never_another_owners_answer(unscheduled, owners):
    admin, alice, bob = owners
    job = owned_job(unscheduled, "alice")
    url = f"/v1/jobs/{job}/metrics?keys=reward/mean"
    for client in (alice, alice, admin, admin):  # learned and cached for alice's and the admin's views
        assert client.get(url).status_code == 200
    for _ in range(2):
        refused = bob.get(url)
        assert refused.status_code == 404 and refused.json()["error"]["param"] == "job_id"


def test_a_spec_may_name_only_the_submitters_uploads(unscheduled, owners):
    admin, alice, bob = owners
    data = upload(alice)["id"]
    code = upload(alice, "score.py", b"def score(prompt, response, ground_truth, extra):\n    return 1.0\n")[
        "id"
    ]
    for spec_part, param in (({"data": {"train_path": data}}, "data.train_path"),
                             ({"reward": {"function": f"{code}:score"}}, "reward.function")):  # fmt: skip
        from tests.api_util import tiny_job

        refused = bob.post("/v1/jobs/validate", json=tiny_job(**spec_part))
        assert refused.status_code == 422 and refused.json()["error"]["param"] == param, refused.text
        assert "no uploaded file" in refused.json()["error"]["message"]
    tried = bob.post("/v1/rewards/validate", json={"function": f"{code}:score", "rows": [{"response": "2"}]})
    assert tried.status_code == 422 and tried.json()["error"]["param"] == "function"
    mine = alice.post("/v1/rewards/validate", json={"function": f"{code}:score", "rows": [{"response": "2"}]})
    assert mine.status_code == 200, mine.text


def test_every_write_is_in_the_audit_log_with_its_owner_key_and_request_id(unscheduled, owners):
    admin, alice, bob = owners
    job = owned_job(unscheduled, "alice", checkpoint=False)
    rid = "req-owners-audit-cancel"
    assert alice.post(f"/v1/jobs/{job}/cancel", headers={"x-request-id": rid}).status_code == 200
    assert bob.post(f"/v1/jobs/{job}/pause").status_code == 404  # refused: not recorded
    entries = admin.get("/v1/audit", params={"target": job}).json()["data"]
    assert [(e["owner"], e["action"], e["request_id"], e["target_owner"]) for e in entries] == [
        ("alice", "cancel", rid, "alice")
    ]
    assert entries[0]["key_id"].startswith("key-")
    uploaded = upload(alice, "tiny.jsonl", b'{"secret": "data"}\n')["id"]  # small, and JSON itself
    (entry,) = admin.get("/v1/audit", params={"target": uploaded}).json()["data"]
    assert (entry["action"], entry["target_owner"]) == ("upload", "alice")
    assert "secret" not in str(entry) and entry["data"] == {"query": "filename=tiny.jsonl"}  # never the file
    assert alice.get("/v1/audit").status_code == 403
    assert {
        e["owner"] for e in admin.get("/v1/audit", params={"owner": "bob", "limit": 1000}).json()["data"]
    } <= {"bob"}


def test_the_prometheus_scrape_of_an_owner_holds_only_that_owners_jobs(unscheduled, owners):
    admin, alice, bob = owners
    a_job, b_job = owned_job(unscheduled, "alice"), owned_job(unscheduled, "bob")
    store = unscheduled.service.store
    store.update_job(a_job, latest_metrics={"critic/score/mean": 0.25})
    store.update_job(b_job, latest_metrics={"critic/score/mean": 0.75})
    scraped = {
        name: client.get("/metrics") for name, client in (("admin", admin), ("alice", alice), ("bob", bob))
    }
    assert all(
        r.status_code == 200 and r.headers["content-type"].startswith("text/plain") for r in scraped.values()
    )
    families = {name: list(text_string_to_metric_families(r.text)) for name, r in scraped.items()}
    for name, mine, theirs in (("alice", a_job, b_job), ("bob", b_job, a_job)):
        jobs = {s.labels.get("job") for f in families[name] for s in f.samples}
        assert mine in jobs and theirs not in jobs, f"{name} scraped {jobs}"
        (queued,) = [s.value for f in families[name] for s in f.samples if s.labels == {"state": "queued"}]
        assert queued == len(store.list_jobs(status=["queued"], owner=name, limit=1000)[0])
        assert not any(f.name == "tandem_request_seconds" for f in families[name])  # everyone's traffic
    seen = {s.labels.get("job") for f in families["admin"] for s in f.samples}
    assert {a_job, b_job} <= seen and any(f.name == "tandem_request_seconds" for f in families["admin"])
