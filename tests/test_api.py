"""The REST control plane against a live service: uvicorn on 127.0.0.1, the tests' local Ray, SQLite."""

from __future__ import annotations

import httpx
import pytest

from api.auth import hash_token, new_key
from tests.api_util import start_service, tiny_job, wait_for, wait_for_step


@pytest.fixture(scope="module")
def held(unscheduled, ray_cluster):
    """An admin client of a service that starts no job: for tests of job records that need no run
    (on `live` a job the scheduler picked up before its pause or cancel would start its workers). A
    submission is checked against the cluster: Ray's."""
    with unscheduled.client() as client:
        yield client


@pytest.fixture(scope="module")
def finished_job(api):
    created = api.post("/v1/jobs", json=tiny_job())
    assert created.status_code == 201, created.text
    return wait_for(api, created.json()["id"], ("succeeded", "failed", "cancelled"))


def test_probes_are_open_and_everything_else_needs_a_token(live):
    assert httpx.get(live.url + "/healthz").json() == {"status": "ok"}
    assert httpx.get(live.url + "/readyz").status_code == 200
    missing = httpx.get(live.url + "/v1/version")
    assert missing.status_code == 401 and missing.headers["www-authenticate"].startswith("Bearer")
    assert missing.json()["error"]["type"] == "authentication_error"
    bad = httpx.get(live.url + "/v1/jobs", headers={"Authorization": "Bearer nope"})
    assert bad.status_code == 401 and bad.json()["error"]["code"] == "invalid_token"
    assert httpx.get(live.url + "/metrics").status_code == 401
    reader = new_key()
    live.service.store.add_token("reader", hash_token(reader), ["read"])
    with live.client(reader) as client:
        assert client.get("/v1/jobs").status_code == 200
        denied = client.post("/v1/jobs", json=tiny_job())
        assert denied.status_code == 403 and denied.json()["error"]["param"] == "Authorization"


def test_every_response_has_a_request_id(live, api):
    assert httpx.get(live.url + "/healthz").headers["x-request-id"].startswith("req_")
    assert api.get("/v1/jobs", headers={"x-request-id": "mine-1"}).headers["x-request-id"] == "mine-1"


@pytest.mark.parametrize(
    "patch,param",
    [
        ({"trainer": {"total_steps": 0}}, "trainer.total_steps"),
        ({"trainer": {"bogus": 1}}, "trainer.bogus"),
        ({"method": "dpo"}, "method"),
        ({"reward": {"function": "no_such_module:f"}}, "reward.function"),
        ({"model": {"builtin": None, "path": "/nope"}}, "model.path"),
        ({"rollout": {"backend": "sglang"}}, "rollout.backend"),
    ],
)
def test_bad_specs_are_422_naming_the_field(api, patch, param):
    response = api.post("/v1/jobs", json=tiny_job(**patch))
    assert response.status_code == 422, response.text
    error = response.json()["error"]
    assert error["param"] == param and param in error["message"]


def test_a_job_runs_to_completion_and_keeps_its_record(api, finished_job):
    job = finished_job
    assert job["status"] == "succeeded" and job["step"] == job["total_steps"] == 3
    assert job["progress"] == 1.0 and "critic/score/mean" in job["latest_metrics"]
    kinds = [e["kind"] for e in api.get(f"/v1/jobs/{job['id']}/events").json()["data"]]
    assert kinds[0] == "created" and kinds[-1] == "succeeded" and "checkpoint" in kinds
    history = api.get(
        f"/v1/jobs/{job['id']}/metrics", params={"keys": "actor/pg_loss,critic/score/mean"}
    ).json()
    assert [row["step"] for row in history["data"]] == [1, 2, 3]
    assert set(history["data"][0]["values"]) == {"actor/pg_loss", "critic/score/mean"}
    window = api.get(f"/v1/jobs/{job['id']}/metrics", params={"step_min": 2, "step_max": 2}).json()["data"]
    assert [row["step"] for row in window] == [2]
    logs = api.get(f"/v1/jobs/{job['id']}/logs", params={"tail": 50}).json()["data"]
    assert any("step 3/3" in row["line"] for row in logs)
    steps = [c["step"] for c in api.get(f"/v1/jobs/{job['id']}/checkpoints").json()["data"]]
    assert steps == [1, 2, 3]
    prom = api.get("/metrics").text
    succeeded = len(api.get("/v1/jobs", params={"status": "succeeded", "limit": 100}).json()["data"])
    assert succeeded >= 1  # other tests of the module may have finished jobs too, in any order
    assert (
        f'tandem_jobs{{state="succeeded"}} {float(succeeded)}' in prom
        and "tandem_request_seconds_bucket" in prom
    )


def test_event_stream_replays_and_resumes_from_last_event_id(api, finished_job):
    url = f"/v1/jobs/{finished_job['id']}/events/stream"
    events = []
    with api.stream("GET", url) as stream:
        for line in stream.iter_lines():
            if line.startswith("id: "):
                events.append(int(line[4:]))
            if line.startswith("event: end"):
                break
    assert len(events) >= 5 and events == sorted(events)
    resumed = []
    with api.stream("GET", url, headers={"Last-Event-ID": str(events[2])}) as stream:
        for line in stream.iter_lines():
            if line.startswith("id: "):
                resumed.append(int(line[4:]))
            if line.startswith("event: end"):
                break
    assert resumed == events[3:]


def test_idempotency_key(held):
    api = held
    spec = tiny_job(metadata={"suite": "idem"})
    headers = {"Idempotency-Key": "key-123"}
    first = api.post("/v1/jobs", json=spec, headers=headers)
    again = api.post("/v1/jobs", json=spec, headers=headers)
    assert first.status_code == 201 and again.status_code == 200
    assert again.json()["id"] == first.json()["id"]
    other = api.post("/v1/jobs", json=tiny_job(metadata={"suite": "other"}), headers=headers)
    assert other.status_code == 409 and other.json()["error"]["param"] == "Idempotency-Key"
    api.post(f"/v1/jobs/{first.json()['id']}/cancel")


def test_pagination_and_filters(held):
    api = held
    ids = []
    for i in range(3):
        job = api.post("/v1/jobs", json=tiny_job(metadata={"suite": "page", "i": str(i)})).json()
        api.post(f"/v1/jobs/{job['id']}/pause")
        ids.append(job["id"])
    page = api.get("/v1/jobs", params={"metadata": "suite:page", "limit": 2}).json()
    assert page["object"] == "list" and page["has_more"] is True
    assert [j["id"] for j in page["data"]] == ids[::-1][:2]
    rest = api.get("/v1/jobs", params={"metadata": "suite:page", "limit": 2, "after": ids[1]}).json()
    assert [j["id"] for j in rest["data"]] == [ids[0]] and rest["has_more"] is False
    for job_id in ids:
        wait_for(api, job_id, ("paused",), timeout_s=120)
    paused = api.get("/v1/jobs", params={"status": "paused", "metadata": "suite:page"}).json()["data"]
    assert {j["id"] for j in paused} == set(ids)
    for job_id in ids:
        assert api.post(f"/v1/jobs/{job_id}/cancel").json()["status"] == "cancelled"
        assert api.delete(f"/v1/jobs/{job_id}").json()["deleted"] is True
    assert api.get(f"/v1/jobs/{ids[0]}").status_code == 404


def test_pause_resume_hyperparameters_fork_and_cancel(api):
    job = api.post(
        "/v1/jobs", json=tiny_job(trainer={"total_steps": 3000}, metadata={"suite": "steer"})
    ).json()
    wait_for_step(api, job["id"], 1)
    patched = api.patch(f"/v1/jobs/{job['id']}/hyperparameters", json={"lr": 5e-4})
    assert patched.status_code == 200 and patched.json()["spec"]["optim"]["lr"] == 5e-4
    bad = api.patch(f"/v1/jobs/{job['id']}/hyperparameters", json={"max_new_tokens": 9})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "max_new_tokens"
    assert api.post(f"/v1/jobs/{job['id']}/pause").json()["status"] in ("pausing", "paused")
    paused = wait_for(api, job["id"], ("paused",))
    kinds = [
        e["kind"] for e in api.get(f"/v1/jobs/{job['id']}/events", params={"limit": 1000}).json()["data"]
    ]
    assert "hyperparameters_requested" in kinds and kinds[-1] == "paused"
    # Forked while paused: once resumed, the job's keep_last pruning may remove this checkpoint.
    fork = api.post(
        f"/v1/jobs/{job['id']}/fork",
        json={
            "checkpoint_step": paused["step"],
            "overrides": {"trainer": {"total_steps": paused["step"] + 1}},
        },
    )
    assert fork.status_code == 201 and fork.json()["parent_id"] == job["id"]
    assert api.post(f"/v1/jobs/{job['id']}/resume").json()["status"] == "queued"
    wait_for_step(api, job["id"], paused["step"] + 1)
    resumed_lrs = api.get(f"/v1/jobs/{job['id']}/metrics", params={"keys": "actor/lr"}).json()["data"]
    assert resumed_lrs[-1]["values"]["actor/lr"] == pytest.approx(5e-4)  # the edit survived the pause
    assert api.post(f"/v1/jobs/{job['id']}/cancel").json()["status"] in ("cancelling", "cancelled")
    assert wait_for(api, job["id"], ("cancelled",))["status"] == "cancelled"
    child = wait_for(api, fork.json()["id"], ("succeeded", "failed"))
    assert child["status"] == "succeeded" and child["step"] == paused["step"] + 1
    child_events = api.get(f"/v1/jobs/{child['id']}/events").json()["data"]
    assert any(e["kind"] == "resumed" and e["data"]["step"] == paused["step"] for e in child_events)
    # A cancelled job keeps its record: events, metrics and checkpoints are all still there.
    assert api.get(f"/v1/jobs/{job['id']}/checkpoints").json()["data"]
    assert api.post(f"/v1/jobs/{job['id']}/resume").status_code == 409


def test_cluster_and_version(api):
    cluster = api.get("/v1/cluster").json()
    assert cluster["cpus"]["total"] >= 1 and cluster["nodes"][0]["alive"] is True
    version = api.get("/v1/version").json()
    assert version["rollout_backends"]["hf"]["available"] is True
    assert version["rollout_backends"]["sglang"]["available"] is False


def test_reward_validation(api):
    ok = api.post(
        "/v1/rewards/validate",
        json={"function": "builtin:arithmetic", "rows": [{"response": "12", "ground_truth": "12"},
                                                         {"response": "13", "ground_truth": "12"}]},
    )  # fmt: skip
    assert ok.status_code == 200 and ok.json()["scores"] == [1.0, 0.0]
    bad = api.post("/v1/rewards/validate", json={"function": "nope_mod:f", "rows": [{"response": "x"}]})
    assert bad.status_code == 422 and bad.json()["error"]["param"] == "function"
    assert "nope_mod" in bad.json()["error"]["message"]


def test_jobs_survive_a_restart_and_running_ones_resume(live, tmp_path, ray_cluster):

    first = start_service(tmp_path)
    with first.client() as client:
        job = client.post("/v1/jobs", json=tiny_job(trainer={"total_steps": 4000})).json()
        wait_for_step(client, job["id"], 2)
    first.stop()  # pauses the running job: it checkpoints at its step boundary
    second = start_service(tmp_path)
    try:
        with second.client() as client:
            listed = [j["id"] for j in client.get("/v1/jobs").json()["data"]]
            assert job["id"] in listed
            record = client.get(f"/v1/jobs/{job['id']}").json()
            events = client.get(f"/v1/jobs/{job['id']}/events", params={"limit": 1000}).json()["data"]
            assert record["status"] in ("queued", "running"), [e["kind"] for e in events]
            assert record["step"] >= 2
            wait_for_step(client, job["id"], record["step"] + 1)
            kinds = [
                e["kind"]
                for e in client.get(f"/v1/jobs/{job['id']}/events", params={"limit": 1000}).json()["data"]
            ]
            assert "service_shutdown" in kinds and "resumed" in kinds
            client.post(f"/v1/jobs/{job['id']}/cancel")
            wait_for(client, job["id"], ("cancelled",))
    finally:
        second.stop()


def test_bad_hyperparameter_values_and_fork_overrides_are_422(held):
    api = held
    job = api.post("/v1/jobs", json=tiny_job(metadata={"suite": "bad-values"})).json()
    api.post(f"/v1/jobs/{job['id']}/pause")
    bad = api.patch(f"/v1/jobs/{job['id']}/hyperparameters", json={"temperature": -1})
    assert bad.status_code == 422 and bad.json()["error"]["param"] == "rollout.temperature"
    api.post(f"/v1/jobs/{job['id']}/cancel")


def test_non_finite_metrics_are_stored_as_null(unscheduled, held):
    api = held
    job = api.post("/v1/jobs", json=tiny_job(metadata={"suite": "nan"})).json()
    api.post(f"/v1/jobs/{job['id']}/pause")
    unscheduled.service.store.add_metrics(job["id"], 1, {"actor/pg_loss": float("nan"), "ok": 1.0})
    rows = api.get(f"/v1/jobs/{job['id']}/metrics").json()["data"]
    assert rows[-1]["values"] == {"actor/pg_loss": None, "ok": 1.0}
    api.post(f"/v1/jobs/{job['id']}/cancel")
