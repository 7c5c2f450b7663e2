"""The Tinker API's wire layer with the official SDK (tinker 0.38.0) against a real uvicorn service:
keys, sessions, capabilities, refusals naming the field, unsupported calls, futures, owners, and the
protobuf codec against the SDK's own generated messages. No session host is needed here (the
service runs without Ray: a model's work fails at once, naming the host); tests/test_tinker_api.py
runs the loops on a real host."""

from __future__ import annotations

import time

import httpx
import pytest

pytest.importorskip("tinker")
import tinker  # noqa: E402
from tinker import types  # noqa: E402

from api.auth import hash_token  # noqa: E402
from api.settings import ServeSettings  # noqa: E402
from service.quotas import Quota  # noqa: E402
from service.tinker_wire import (  # noqa: E402
    read_forward_backward,
    write_forward_backward_output,
    write_sample_response,
)
from tests.api_util import start_service  # noqa: E402
from tests.owners_util import make_key  # noqa: E402
from tests.tinker_loops import close_clients, owner_keys, point_sdk, service_client  # noqa: E402

MISSING = "/nonexistent/tinker-base"  # served, but its host cannot start: work fails naming it


@pytest.fixture(scope="module")
def svc(tmp_path_factory):
    settings = ServeSettings(tinker_base_models=["tiny-qwen2", "qwen2-1m", MISSING])
    live = start_service(tmp_path_factory.mktemp("tinker-wire"), schedule=False, settings=settings)
    yield live
    close_clients()
    live.stop()


@pytest.fixture(scope="module")
def keys(svc):
    return owner_keys(svc)


@pytest.fixture
def sdk_env(svc, keys, monkeypatch):
    point_sdk(monkeypatch, svc.url, keys["alice"])


def http(svc, key: str) -> httpx.Client:
    return httpx.Client(base_url=svc.url, headers={"X-API-Key": key}, timeout=30)


def tinker_rows(svc) -> list:
    return [j for j in svc.service.store.list_jobs(limit=1000)[0] if j.method == "tinker"]


def test_keys_pass_the_sdk_check_and_work_on_tandem_routes(svc, keys):
    assert svc.token.startswith("tml-") and keys["alice"].startswith("tml-")
    for header in ({"X-API-Key": keys["alice"]}, {"Authorization": f"Bearer {keys['alice']}"}):
        with httpx.Client(base_url=svc.url, headers=header, timeout=30) as client:
            assert client.get("/v1/jobs").status_code == 200
            assert client.get("/api/v1/get_server_capabilities").status_code == 200
    old = "tdm_" + "x" * 43  # a key of the old form, made before tml- keys: still valid on both
    svc.service.store.add_token("old", hash_token(old), ["read", "write"], "carol", False)
    with http(svc, old) as client:
        assert client.get("/v1/jobs").status_code == 200
        assert client.post("/api/v1/create_session", json={"tags": []}).status_code == 200
    with http(svc, "tml-unknown") as client:
        refused = client.get("/api/v1/get_server_capabilities")
    assert refused.status_code == 401
    assert refused.json()["category"] == "user" and isinstance(
        refused.json()["error"], str
    )  # the SDK's shape


def test_sdk_capabilities_and_refusals_name_the_field(svc, keys, sdk_env):
    sc = service_client()
    names = [
        m.model_name
        for m in tinker.RestClient(base_url=svc.url, api_key=keys["alice"])
        .get_server_capabilities()
        .result()
        .supported_models
    ]
    assert "tiny-qwen2" in names and "qwen2-1m" in names
    with pytest.raises(tinker.BadRequestError) as unknown:
        sc.create_lora_training_client(base_model="no-such-model", rank=8).result()
    assert "base_model" in str(unknown.value) and "no-such-model" in str(unknown.value)
    with pytest.raises(tinker.BadRequestError) as big:
        sc.create_lora_training_client(base_model="tiny-qwen2", rank=4096).result()
    assert "lora_config.rank" in str(big.value) and "64" in str(big.value)
    assert tinker_rows(svc) == []  # nothing stored
    assert (
        tinker.RestClient(base_url=svc.url, api_key=keys["alice"]).list_training_runs().result().training_runs
        == []
    )


def test_unsupported_calls_answer_at_once_naming_the_feature(svc, keys, sdk_env):
    rest = tinker.RestClient(base_url=svc.url, api_key=keys["alice"])
    started = time.monotonic()
    with pytest.raises(tinker.BadRequestError) as err:
        rest.get_weights_info_by_tinker_path("tinker://job-x/weights/a").result()
    assert "unsupported feature" in str(err.value) and "weights_info" in str(err.value)
    assert time.monotonic() - started < 10


def test_a_host_that_cannot_start_fails_the_future_naming_it_and_stores_nothing(svc, sdk_env):
    sc = service_client()
    with pytest.raises(tinker.RequestFailedError) as err:
        sc.create_lora_training_client(base_model=MISSING, rank=4).result(timeout=60)
    assert f"session host '{MISSING}' failed to start" in str(err.value)
    deadline = time.monotonic() + 10
    while tinker_rows(svc) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert tinker_rows(svc) == []


def test_owners_never_see_each_others_sessions_futures_or_runs(svc, keys):
    with http(svc, keys["alice"]) as alice, http(svc, keys["bob"]) as bob:
        session = alice.post("/api/v1/create_session", json={"tags": []}).json()["session_id"]
        assert alice.post("/api/v1/session_heartbeat", json={"session_id": session}).status_code == 200
        made = alice.post("/api/v1/create_model", json={"session_id": session, "model_seq_id": 0,
                                                         "base_model": MISSING, "lora_config": {"rank": 4}})  # fmt: skip
        request_id = made.json()["request_id"]
        model_id = f"{session}:train:0"
        bobs = [
            bob.post("/api/v1/session_heartbeat", json={"session_id": session}),
            bob.get(f"/api/v1/sessions/{session}"),
            bob.post(f"/api/v1/sessions/{session}/finish", json={}),
            bob.post(
                "/api/v1/create_model",
                json={
                    "session_id": session,
                    "model_seq_id": 1,
                    "base_model": "tiny-qwen2",
                    "lora_config": {"rank": 4},
                },
            ),  # fmt: skip
            bob.post(
                "/api/v1/create_sampling_session",
                json={"session_id": session, "sampling_session_seq_id": 0, "base_model": "tiny-qwen2"},
            ),  # fmt: skip
            bob.post("/api/v1/retrieve_future", json={"request_id": request_id}),
            bob.post("/api/v1/cancel_future", json={"request_id": request_id}),
            bob.post("/api/v1/get_info", json={"model_id": model_id}),
            bob.post(
                "/api/v1/optim_step", json={"model_id": model_id, "adam_params": {"learning_rate": 1e-3}}
            ),
            bob.post("/api/v1/save_weights", json={"model_id": model_id, "path": "a"}),
            bob.post("/api/v1/save_weights_for_sampler", json={"model_id": model_id, "path": "a"}),
            bob.post(
                "/api/v1/load_weights",
                json={"model_id": model_id, "path": "tinker://x/weights/a", "optimizer": False},
            ),  # fmt: skip
            bob.post("/api/v1/unload_model", json={"model_id": model_id}),
            bob.post(
                "/api/v1/forward_backward",
                json={
                    "model_id": model_id,
                    "forward_backward_input": {"data": [], "loss_fn": "cross_entropy"},
                },
            ),  # fmt: skip
            bob.post(
                "/api/v1/asample",
                json={
                    "sampling_session_id": f"{session}:sample:0",
                    "num_samples": 1,
                    "prompt": {"chunks": [{"tokens": [1]}]},
                    "sampling_params": {},
                },
            ),  # fmt: skip
            bob.get(f"/api/v1/samplers/{session}:sample:0"),
            bob.get(f"/api/v1/training_runs/{model_id}"),
            bob.get(f"/api/v1/training_runs/{model_id}/checkpoints"),
            bob.get(f"/api/v1/training_runs/{model_id}/checkpoints/weights/a/archive"),
        ]
        for answer in bobs:
            assert answer.status_code == 404, (answer.request.url, answer.text)
            assert answer.json()["category"] == "user" and answer.json()["param"]
        assert bob.get("/api/v1/sessions").json()["sessions"] == []
        assert session in alice.get("/api/v1/sessions").json()["sessions"]
        done = alice.post("/api/v1/retrieve_future", json={"request_id": request_id}).json()
        assert done.get("type") == "try_again" or "session host" in done["error"]


def test_protobuf_codec_matches_the_sdks_generated_messages():
    from tinker.proto.request_conv import forward_backward_request_to_proto
    from tinker.proto.response_conv import deserialize_forward_backward_output, deserialize_sample_response

    datum = types.Datum(
        model_input=types.ModelInput.from_ints([1, 2, 300]),
        loss_fn_inputs={"target_tokens": types.TensorData(data=[2, 300, 4], dtype="int64", shape=[3]),
                        "weights": types.TensorData(data=[0.0, 1.0, 0.5], dtype="float32", shape=[3])},
    )  # fmt: skip
    request = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(data=[datum], loss_fn="ppo",
                                                          loss_fn_config={"clip_low_threshold": 0.8}),
        model_id="s:train:0", seq_id=7,
    )  # fmt: skip
    proto = forward_backward_request_to_proto(request)
    proto.forward_only = True
    read = read_forward_backward(proto.SerializeToString())
    assert read["model_id"] == "s:train:0" and read["seq_id"] == 7 and read["forward_only"] is True
    given = read["forward_backward_input"]
    assert given["loss_fn"] == "ppo" and given["loss_fn_config"] == {"clip_low_threshold": pytest.approx(0.8)}
    assert given["data"][0]["model_input"] == {"chunks": [{"tokens": [1, 2, 300]}]}
    assert given["data"][0]["loss_fn_inputs"]["target_tokens"] == {
        "data": [2, 300, 4],
        "dtype": "int64",
        "shape": [3],
    }
    assert given["data"][0]["loss_fn_inputs"]["weights"]["data"] == [0.0, 1.0, 0.5]

    out = deserialize_forward_backward_output(write_forward_backward_output(
        [{"logprobs": {"data": [-1.5, -0.25], "dtype": "float32", "shape": [2]}},
         {"logprobs": {"data": [-3.0], "dtype": "float32", "shape": [1]}}], {"loss:sum": 4.75}))  # fmt: skip
    assert out.metrics == {"loss:sum": 4.75}
    assert [o["logprobs"].tolist() for o in out.loss_fn_outputs] == [[-1.5, -0.25], [-3.0]]
    sample = deserialize_sample_response(write_sample_response(
        [{"tokens": [5, 6], "logprobs": [-0.5, -0.125], "stop_reason": "length"},
         {"tokens": [7], "logprobs": [-1.0], "stop_reason": "stop"}], [None, -2.5]))  # fmt: skip
    assert [(s.tokens, s.logprobs, s.stop_reason) for s in sample.sequences] == [
        ([5, 6], [-0.5, -0.125], "length"), ([7], [-1.0], "stop")]  # fmt: skip
    assert sample.prompt_logprobs == [None, -2.5]


def test_the_dispatcher_takes_turns_between_owners_then_their_sessions(tmp_path):
    """Host._next_batch alone (no actor): round-robin between owners, then between an owner's
    queues, one op per queue per batch, in each queue's order; a cancelled op is skipped."""
    from collections import OrderedDict, deque

    from service.tinker_hosts import Host, HostOptions, Op
    from service.tinker_sessions import FutureTable
    from workers.session_host import SessionWorker

    futures = FutureTable()
    host = Host("tiny-qwen2", tmp_path, futures, HostOptions(max_batch=2))
    ops = {}
    for owner, queue, n in (("alice", "a1", 3), ("alice", "a2", 3), ("alice", "a3", 3), ("bob", "b1", 6)):
        for i in range(n):
            op = Op(
                futures.create(owner, "forward"),
                owner,
                queue,
                SessionWorker.forward_backward_calls,
                {"i": i},
                lambda ok: ({}, None),
            )
            ops[(queue, i)] = op
            host._queues.setdefault(owner, OrderedDict()).setdefault(queue, deque()).append(op)
    futures.cancel(ops[("b1", 2)].future)
    batches = []
    while host._queues:
        batches.append([(op.queue, op.kwargs["i"]) for op in host._next_batch()])
    assert batches[0] == [("a1", 0), ("b1", 0)] and batches[1] == [("a2", 0), ("b1", 1)]
    assert batches[2] == [("a3", 0), ("b1", 3)]  # b1's op 2 was cancelled
    bob_first = [i for i, b in enumerate(batches) if ("b1", 5) in b][0]
    assert bob_first <= 4  # bob's one session gets half the turns, not a quarter
    for queue in ("a1", "a2", "a3", "b1"):
        order = [i for b in batches for q, i in b if q == queue]
        assert order == sorted(order)
    assert all(len({q for q, _ in b}) == len(b) for b in batches)  # one op per queue per batch


def test_a_session_without_heartbeats_ends(svc, keys):
    tinker_svc = svc.server.config.app.state.tinker
    with http(svc, keys["alice"]) as alice:
        old = alice.post("/api/v1/create_session", json={"tags": []}).json()["session_id"]
        tinker_svc.session_ttl_s = 0.2
        try:
            time.sleep(0.3)
            alice.post("/api/v1/create_session", json={"tags": []})
        finally:
            tinker_svc.session_ttl_s = 600.0
        gone = alice.post("/api/v1/session_heartbeat", json={"session_id": old})
    assert gone.status_code == 404 and gone.json()["param"] == "session_id"


def test_session_quota_is_refused_at_once_naming_it(svc):
    with svc.client() as admin:
        key = make_key(admin, "erin")["key"]
        assert admin.put("/v1/quotas/erin", json={"tinker_sessions": 1}).status_code == 200
    with http(svc, key) as erin:
        assert erin.post("/api/v1/create_session", json={"tags": []}).status_code == 200
        refused = erin.post("/api/v1/create_session", json={"tags": []})
    # 403, not 429: the SDK retries a 429 for minutes instead of showing it
    assert refused.status_code == 403 and refused.json()["param"] == "quota.tinker_sessions"


def test_an_owner_without_a_session_quota_still_has_a_bounded_number_of_sessions(svc):
    """Sessions live in memory until 10 minutes after their last heartbeat: unbounded, one key could
    open them in a loop until the service runs out of memory."""
    with svc.client() as admin:
        key = make_key(admin, "frank")["key"]
    limit = Quota().tinker_sessions
    assert limit is not None and limit > 0
    with http(svc, key) as frank:
        for _ in range(limit):
            assert frank.post("/api/v1/create_session", json={"tags": []}).status_code == 200
        refused = frank.post("/api/v1/create_session", json={"tags": []})
    assert refused.status_code == 403 and refused.json()["param"] == "quota.tinker_sessions", refused.text


def test_a_finished_session_no_longer_counts_in_the_session_quota(svc):
    """The SDK's close() finishes its session: before, it stayed (and counted) until its heartbeats had
    been missing for 10 minutes, so a script that opened and closed clients met the quota."""
    with svc.client() as admin:
        key = make_key(admin, "gail")["key"]
        assert admin.put("/v1/quotas/gail", json={"tinker_sessions": 1}).status_code == 200
    with http(svc, key) as gail:
        for _ in range(3):
            session = gail.post("/api/v1/create_session", json={"tags": []})
            assert session.status_code == 200, session.text
            assert gail.post(f"/api/v1/sessions/{session.json()['session_id']}/finish").status_code == 200
        gone = gail.post("/api/v1/session_heartbeat", json={"session_id": session.json()["session_id"]})
    assert gone.status_code == 404 and gone.json()["param"] == "session_id"
