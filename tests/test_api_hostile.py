"""A hostile tenant against the REST control plane, where the fuzzer and the owner tests do not reach:
a body sent without a Content-Type, a hyper-parameter edit naming one unknown name among known ones,
more live streams than one owner may hold, a request body that never finishes, a metrics filter of
thousands of names, and two edits of one job at once.

The service runs without Ray (jobs stay queued, so their streams stay live); `tests/owners_util.py`
puts the jobs in its store.
"""

from __future__ import annotations

import json
import socket
import time

import httpx
import pytest

from api import middleware
from tests.owners_util import owned_job, two_owners


@pytest.fixture(scope="module")
def owners(unscheduled):
    with two_owners(unscheduled) as clients:
        yield clients


def _error(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    return response.json()["error"]


def test_a_json_body_without_a_content_type_is_a_415_naming_the_header(unscheduled, owners):
    """Python's requests sends `data=` with no Content-Type; FastAPI then reads the JSON as bytes."""
    _, alice, _ = owners
    job_id = owned_job(unscheduled, "alice", checkpoint=False)
    for path, body in ((f"/v1/jobs/{job_id}", b'{"name": "renamed"}'),
                       (f"/v1/jobs/{job_id}/hyperparameters", b'{"lr": 0.001}')):  # fmt: skip
        sent = alice.patch(path, content=body)  # httpx adds no Content-Type to raw bytes
        error = _error(sent, 415)
        assert error["param"] == "body" and error["code"] == "unsupported_media_type"
        assert "Content-Type: application/json" in error["message"] and "has none" in error["message"]
    assert alice.get(f"/v1/jobs/{job_id}").json()["name"] is None


def test_an_unknown_hyperparameter_after_a_known_one_is_the_one_named(unscheduled, owners):
    _, alice, _ = owners
    job_id = owned_job(unscheduled, "alice", checkpoint=False)
    error = _error(alice.patch(f"/v1/jobs/{job_id}/hyperparameters", json={"lr": 1e-4, "max_len": 9}), 400)
    assert error["param"] == "max_len" and error["code"] == "unknown_hyperparameter"
    assert "'max_len' cannot be changed" in error["message"]
    assert unscheduled.service.store.get_job(job_id).spec["optim"]["lr"] != 1e-4


def test_an_owner_holds_a_bounded_number_of_live_streams(unscheduled, owners, monkeypatch):
    """Each live stream polls the store: one owner opening streams without end would starve the rest."""
    from api.streams import StreamSlots

    # setitem: monkeypatch.setattr reads a Starlette State's attribute as absent and deletes it on undo
    monkeypatch.setitem(unscheduled.server.config.app.state._state, "streams", StreamSlots(2))
    _, alice, bob = owners
    mine, theirs = owned_job(unscheduled, "alice"), owned_job(unscheduled, "bob")
    paths = [f"/v1/jobs/{mine}/{kind}/stream" for kind in ("events", "logs", "metrics")]
    with alice.stream("GET", paths[0]) as first, alice.stream("GET", paths[1]) as second:
        assert first.status_code == second.status_code == 200
        with alice.stream("GET", paths[2]) as third:  # opened only: a live stream's body never ends
            assert third.status_code == 429
            error = json.loads(third.read())["error"]
        assert error["param"] == "stream" and error["code"] == "too_many_streams"
        with bob.stream("GET", f"/v1/jobs/{theirs}/events/stream") as other:
            assert other.status_code == 200  # the bound is per owner
    deadline = time.monotonic() + 15  # the server sees the disconnects at its next poll
    while True:
        with alice.stream("GET", paths[2]) as again:
            if again.status_code == 200:
                break
            assert again.status_code == 429 and time.monotonic() < deadline


def test_a_request_body_that_stops_coming_is_a_408_not_a_request_held_for_ever(unscheduled, monkeypatch):
    """A slow-loris client, before any key is checked: the body says 100 bytes and sends 10."""
    monkeypatch.setattr(middleware, "BODY_IDLE_S", 0.5)
    host, port = unscheduled.url.removeprefix("http://").split(":")
    head = (f"POST /v1/jobs HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            "Content-Length: 100\r\n\r\n")  # fmt: skip
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(head.encode() + b'{"method":')
        answer = sock.recv(65536).decode()
    assert answer.startswith("HTTP/1.1 408"), answer
    assert '"param":"body"' in answer and '"code":"body_timeout"' in answer


def test_a_metrics_filter_of_too_many_names_is_a_422_naming_keys(unscheduled, owners):
    """Every row of a page is matched against every name: 6000 prefixes held a thread for half a minute."""
    _, alice, _ = owners
    job_id = owned_job(unscheduled, "alice", checkpoint=False)
    many = ",".join(f"group{i}/*" for i in range(101))
    for path in (f"/v1/jobs/{job_id}/metrics", f"/v1/jobs/{job_id}/metrics/export"):
        error = _error(alice.get(path, params={"keys": many}), 422)
        assert error["param"] == "keys" and error["code"] == "too_many_keys", error
    fits = ",".join(["reward/*", *(f"group{i}/*" for i in range(99))])
    assert alice.get(f"/v1/jobs/{job_id}/metrics", params={"keys": fits}).json()["data"][0]["values"] == {
        "reward/mean": 0.5
    }


def test_two_edits_at_once_both_stay_in_the_stored_spec(unscheduled, owners, monkeypatch):
    """Each edit reads the stored spec, changes it and writes it back (what GET shows and a restart runs):
    two at once must not lose one. The merge is slowed so that the two always overlap."""
    import threading

    from service import service as service_module

    _, alice, _ = owners
    job_id = owned_job(unscheduled, "alice", checkpoint=False)
    merge = service_module._validated_merge

    def slow_merge(*args, **kwargs):
        time.sleep(0.3)
        return merge(*args, **kwargs)

    monkeypatch.setattr(service_module, "_validated_merge", slow_merge)
    edits = [{"lr": 3e-4}, {"entropy_coeff": 0.01}]
    answers: list[httpx.Response] = []

    def edit(changes: dict) -> None:
        answers.append(alice.patch(f"/v1/jobs/{job_id}/hyperparameters", json=changes))

    threads = [threading.Thread(target=edit, args=(e,)) for e in edits]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert [a.status_code for a in answers] == [200, 200], [a.text for a in answers]
    stored = unscheduled.service.store.get_job(job_id).spec
    assert (stored["optim"]["lr"], stored["algorithm"]["entropy_coeff"]) == (3e-4, 0.01)


def test_a_last_event_id_that_is_not_a_row_id_is_a_422_naming_the_header(unscheduled, owners):
    """`'²'.isdigit()` holds but int() refuses it; 5000 digits pass isdigit() too; a 20-digit id passed
    int() and overflowed SQLite inside the open stream."""
    _, alice, _ = owners
    job_id = owned_job(unscheduled, "alice", checkpoint=False)
    url = f"/v1/jobs/{job_id}/logs/stream"
    for value in (b"\xb2", b"9" * 5000, b"9" * 20, b"-1", b"abc"):
        refused = alice.get(url, headers=[(b"Last-Event-ID", value)], timeout=10)
        error = _error(refused, 422)
        assert error["param"].lower() == "last-event-id", (value[:20], error)
    with alice.stream("GET", url, headers={"Last-Event-ID": "0"}, timeout=10) as resumed:
        assert resumed.status_code == 200 and next(resumed.iter_lines()).startswith("id: ")
