"""Hostile and malformed Tinker requests against a real service (uvicorn on 127.0.0.1, SQLite; no
Ray: nothing here reaches a session host): every one is a 4xx in the SDK's error shape naming the
field, never a 500 (which the SDK retries for minutes); a zstd bomb is a 413 after its first
megabyte; a slow body is decoded beside the event loop, so /healthz answers meanwhile; and an
error nobody expected still answers in the error shape, with its request id."""

from __future__ import annotations

import functools
import struct
import threading
import time
import tracemalloc

import httpx
import pytest

pytest.importorskip("tinker")
zstandard = pytest.importorskip("zstandard")

from api.settings import ServeSettings  # noqa: E402
from service.tinker_requests import FLOOR_BYTES, decompressed  # noqa: E402
from service.tinker_service import TinkerError  # noqa: E402
from tests.api_util import start_service, tiny_job  # noqa: E402
from tests.tinker_loops import owner_keys  # noqa: E402

BASE = "/nonexistent/tinker-base"  # served, but its host cannot start: nothing here needs one
PROTO = {"content-type": "application/x-protobuf"}
PENDING = 4  # requests an owner may have unanswered


@pytest.fixture(scope="module")
def svc(tmp_path_factory):
    settings = ServeSettings(tinker_base_models=[BASE], tinker_max_pending_requests=PENDING)
    live = start_service(tmp_path_factory.mktemp("tinker-bad"), schedule=False, settings=settings)
    # no run starts (the scheduler drains, as at shutdown): a training model's ops stay held, as behind
    # a full cluster
    live.service.scheduler._draining = True
    yield live
    live.stop()


@pytest.fixture(scope="module")
def alice(svc):
    with httpx.Client(
        base_url=svc.url, headers={"X-API-Key": owner_keys(svc)["alice"]}, timeout=60
    ) as client:
        yield client


@pytest.fixture(scope="module")
def ids(alice):
    session = alice.post("/api/v1/create_session", json={"tags": []}).json()["session_id"]
    sampler = alice.post("/api/v1/create_sampling_session", json={"session_id": session, "base_model": BASE})
    return {"session": session, "sampler": sampler.json()["sampling_session_id"]}


def _fwd(datum: object = None, **top) -> dict:
    datum = (
        {"model_input": {"chunks": [{"tokens": [1, 2]}]}, "loss_fn_inputs": {}} if datum is None else datum
    )
    return {"model_id": "m", "forward_backward_input": {"loss_fn": "cross_entropy", "data": [datum]}, **top}


def _chunks(tokens: list) -> dict:
    return {"model_input": {"chunks": [{"tokens": tokens}]}, "loss_fn_inputs": {}}


SAMPLE = {"prompt": {"chunks": [{"tokens": [1]}]}}
# (route, body, the field the refusal names); "{session}"/"{sampler}" are filled in with real ids
JSON_CASES = [
    ("create_session", {"tags": 5}, "tags"),
    ("create_session", {"tags": [1, {"a": 1}]}, "tags[0]"),
    ("create_session", [], "body"),
    ("create_model", {"session_id": "{session}", "base_model": BASE, "model_seq_id": 0, "lora_config": "big"},
     "lora_config"),
    ("create_model", {"session_id": "{session}", "base_model": BASE, "model_seq_id": 0, "optimizer_config": 1},
     "optimizer_config"),
    ("create_model", {"session_id": "{session}", "base_model": BASE, "model_seq_id": "0"}, "model_seq_id"),
    ("create_model", {"session_id": "{session}", "base_model": BASE, "model_seq_id": 0,
                      "lora_config": {"rank": 4, "seed": 2**80}}, "lora_config.seed"),
    ("optim_step", {"model_id": "m", "adam_params": [1, 2]}, "adam_params"),
    ("optim_step", {"model_id": "m", "adam_params": {"learning_rate": "fast"}}, "adam_params.learning_rate"),
    ("forward_backward", _fwd(_chunks(["a"])), "forward_backward_input.data[0].model_input.chunks[0].tokens[0]"),
    ("forward_backward", _fwd(_chunks([None])), "forward_backward_input.data[0].model_input.chunks[0].tokens[0]"),
    ("forward_backward", _fwd({"model_input": {"chunks": []}, "loss_fn_inputs": 5}),
     "forward_backward_input.data[0].loss_fn_inputs"),
    ("forward_backward", _fwd({"model_input": {"chunks": []}, "loss_fn_inputs": {"weights": [1.0]}}),
     "forward_backward_input.data[0].loss_fn_inputs.weights"),
    ("forward_backward", _fwd({"model_input": {"chunks": []}, "loss_fn_inputs": {
        "target_tokens": {"data": [1.5], "dtype": "int64"}}}), "forward_backward_input.data[0].loss_fn_inputs.target_tokens"),
    ("forward_backward", _fwd({"model_input": {"chunks": []}, "loss_fn_inputs": {
        "weights": {"data": [1.0, 2.0], "shape": [3]}}}), "forward_backward_input.data[0].loss_fn_inputs.weights"),
    ("forward_backward", _fwd({"model_input": {"chunks": []}, "loss_fn_inputs": {  # finite, but inf as float32
        "advantages": {"data": [1.0, -1e39]}}}), "forward_backward_input.data[0].loss_fn_inputs.advantages"),
    ("forward_backward", _fwd(5), "forward_backward_input.data[0]"),
    ("forward_backward", {"model_id": "m", "forward_backward_input": 5}, "forward_backward_input"),
    ("forward_backward", _fwd({"model_input": {"chunks": [5]}}), "forward_backward_input.data[0].model_input.chunks[0]"),
    ("forward_backward", {"model_id": 7}, "model_id"),
    ("forward", {"model_id": "m", "forward_backward_input": {"loss_fn_config": 5}},
     "forward_backward_input.loss_fn_config"),
    ("asample", {"sampling_session_id": "{sampler}", "prompt": "hello"}, "prompt"),
    ("asample", {"sampling_session_id": "{sampler}", **SAMPLE, "sampling_params": {"max_tokens": "lots"}},
     "sampling_params.max_tokens"),
    ("asample", {"sampling_session_id": "{sampler}", **SAMPLE, "sampling_params": {"seed": 2**80}},
     "sampling_params.seed"),
    ("asample", {"sampling_session_id": "{sampler}", **SAMPLE, "sampling_params": {"seed": -1}},
     "sampling_params.seed"),
    ("asample", {"sampling_session_id": "{sampler}", **SAMPLE, "sampling_params": {"temperature": "hot"}},
     "sampling_params.temperature"),
    ("asample", {"sampling_session_id": "{sampler}", **SAMPLE, "sampling_params": {"stop": 5}}, "sampling_params.stop"),
    ("asample", {"sampling_session_id": "{sampler}", **SAMPLE, "sampling_params": 5}, "sampling_params"),
    ("asample", {"sampling_session_id": "{sampler}", **SAMPLE, "sampling_params": {"top_p": 0}},
     "sampling_params.top_p"),
    ("optim_step", {"model_id": "m", "adam_params": {"learning_rate": -1}}, "adam_params.learning_rate"),
    ("asample", {"sampling_session_id": "{sampler}", "prompt": {"chunks": "x"}}, "prompt.chunks"),
    ("asample", {"sampling_session_id": "{sampler}", **SAMPLE, "num_samples": 10**6}, "num_samples"),
    ("create_sampling_session", {"session_id": "{session}", "model_path": 5}, "model_path"),
    ("save_weights", {"model_id": "m", "path": 5}, "path"),
    ("load_weights", {"model_id": "m", "path": "tinker://x/weights/y", "optimizer": "yes"}, "optimizer"),
    ("retrieve_future", {"request_id": 5}, "request_id"),
    ("session_heartbeat", {"session_id": {}}, "session_id"),
    ("unload_model", {"model_id": None}, "model_id"),
]  # fmt: skip
# the same refusals for non-finite numbers, sent as the JSON literals Python's parser accepts
NON_FINITE = [
    ("optim_step", '{"model_id": "m", "adam_params": {"learning_rate": NaN}}', "adam_params.learning_rate"),
    ("optim_step", '{"model_id": "m", "adam_params": {"learning_rate": Infinity}}', "adam_params.learning_rate"),
    ("optim_step", '{"model_id": "m", "adam_params": {"beta1": -Infinity}}', "adam_params.beta1"),
    ("forward_backward", '{"model_id": "m", "forward_backward_input": {"data": [{"model_input": {"chunks": []}, '
     '"loss_fn_inputs": {"weights": {"data": [NaN]}}}]}}', "forward_backward_input.data[0].loss_fn_inputs.weights.data[0]"),
    ("forward_backward", '{"model_id": "m", "forward_backward_input": {"loss_fn_config": {"beta": Infinity}}}',
     "forward_backward_input.loss_fn_config.beta"),
    ("asample", '{"sampling_session_id": "{sampler}", "prompt": {"chunks": [{"tokens": [1]}]}, '
     '"sampling_params": {"top_p": NaN}}', "sampling_params.top_p"),
]  # fmt: skip


def _fill(value, ids):
    if isinstance(value, str):
        return value.replace("{session}", ids["session"]).replace("{sampler}", ids["sampler"])
    if isinstance(value, dict):
        return {k: _fill(v, ids) for k, v in value.items()}
    if isinstance(value, list):
        return [_fill(v, ids) for v in value]
    return value


def _refused(response: httpx.Response, param: str, status: int = 400) -> dict:
    assert response.status_code == status, (response.status_code, response.text)
    body = response.json()
    assert body["category"] == "user" and body["param"] == param, body
    assert isinstance(body["error"], str) and param in body["error"]
    return body


@pytest.mark.parametrize("route,body,param", JSON_CASES, ids=[f"{r}:{p}" for r, _, p in JSON_CASES])
def test_a_json_body_of_the_wrong_type_is_400_naming_the_field(alice, ids, route, body, param):
    _refused(alice.post(f"/api/v1/{route}", json=_fill(body, ids)), param)


@pytest.mark.parametrize("route,text,param", NON_FINITE, ids=[p for _, _, p in NON_FINITE])
def test_non_finite_numbers_are_refused(alice, ids, route, text, param):
    sent = text.replace("{sampler}", ids["sampler"])
    _refused(
        alice.post(f"/api/v1/{route}", content=sent, headers={"content-type": "application/json"}), param
    )


# Hostile bodies are written byte by byte: a generated message cannot hold a wrong wire type.
def _varint(value: int) -> bytes:
    value &= (1 << 64) - 1
    out = bytearray()
    while value > 0x7F:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    return bytes(out) + bytes([value])


def _len(number: int, payload: bytes) -> bytes:
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def _int(number: int, value: int) -> bytes:
    return _varint(number << 3) + _varint(value)


def _tensor_entry(name: bytes, tensor: bytes) -> bytes:
    return _len(2, _len(1, name) + _len(2, tensor))


MODEL = _len(1, b"s:train:0")
PROTO_CASES = [
    ("odd-length bf16", MODEL + _len(3, _tensor_entry(b"weights", _len(1, b"\x01\x02\x03") + _int(3, 4))),
     "forward_backward_input.data[0].loss_fn_inputs.weights"),
    ("model_id as a varint", _int(1, 5), "model_id"),
    ("a datum as a varint", MODEL + _int(3, 5), "forward_backward_input.data"),
    ("a 3-byte double", MODEL + _len(5, _len(1, b"beta") + _len(2, b"\x00\x00\x00")),
     "forward_backward_input.loss_fn_config.beta"),
    ("a v2 config value of the wrong wire type", MODEL + _len(7, _len(1, b"beta") + _len(2, _len(1, b"xy"))),
     "forward_backward_input.loss_fn_config.beta"),
    ("a chunk as a varint", MODEL + _len(3, _int(1, 3)), "forward_backward_input.data[0].model_input"),
    ("a tensor as a varint", MODEL + _len(3, _len(2, _len(1, b"w") + _int(2, 1))),
     "forward_backward_input.data[0].loss_fn_inputs.w"),
    ("a dtype as bytes", MODEL + _len(3, _tensor_entry(b"w", _len(3, b"x"))),
     "forward_backward_input.data[0].loss_fn_inputs.w"),
    ("a truncated varint", b"\x80", "body"),
    ("a truncated varint in a shape",
     MODEL + _len(3, _tensor_entry(b"w", _len(1, b"\0\0\0\0") + _int(3, 1) + _len(4, b"\x80"))), "body"),
    ("a truncated message", b"\x09\x00", "body"),
    ("field number 0", b"\x00\x00" * 4, "body"),
    ("wire type 3", b"\x0b", "body"),
    ("a model_id that is not UTF-8", _len(1, b"\xff\xfe"), "model_id"),
    ("forward_only as bytes", MODEL + _len(6, b"x"), "forward_only"),
    ("a NaN float32 input", MODEL + _len(3, _len(1, _len(1, _len(1, struct.pack("<2i", 1, 2))))
                                           + _tensor_entry(b"weights", _len(1, struct.pack("<2f", 1.0, float("nan"))) + _int(3, 1))),
     "forward_backward_input.data[0].loss_fn_inputs.weights.data[1]"),
    ("a length past the end", MODEL + b"\x1a\xff\xff\xff\xff\x0f" + b"\0" * 8, "body"),
    ("a 64-bit length prefix", b"\x0a" + b"\xff" * 9 + b"\x01", "body"),
    ("groups nested 100k deep", b"\x7b" * 100_000, "body"),
    ("lengths nested 2000 deep", MODEL + functools.reduce(lambda inner, _: _len(15, inner), range(2000), b"")
     + _int(4, 1), "forward_backward_input.loss_fn"),
    ("megabytes of unknown fields", MODEL + b"\x78\x00" * (1 << 20), "body"),
    ("a shape as 32-bit values", MODEL + _len(3, _tensor_entry(b"w", _int(3, 1) + b"\x25\0\0\0\0")),
     "forward_backward_input.data[0].loss_fn_inputs.w"),
    ("a tensor name that is not UTF-8", MODEL + _len(3, _tensor_entry(b"\xff", _int(3, 1))),
     "forward_backward_input.data[0].loss_fn_inputs"),
    ("an image chunk", MODEL + _len(3, _len(1, _len(2, _len(1, b"png")))),
     "forward_backward_input.data[0].model_input"),
    ("a sparse tensor", MODEL + _len(3, _tensor_entry(b"w", _len(2, b"") + _int(3, 1))),
     "forward_backward_input.data[0].loss_fn_inputs.w"),
    ("a NaN config value", MODEL + _len(5, _len(1, b"beta") + _varint(2 << 3 | 1) + struct.pack("<d", float("nan"))),
     "forward_backward_input.loss_fn_config.beta"),
]  # fmt: skip


@pytest.mark.parametrize(
    "body,param", [(b, p) for _, b, p in PROTO_CASES], ids=[n for n, _, _ in PROTO_CASES]
)
def test_malformed_protobuf_is_400_naming_the_field(alice, body, param):
    _refused(alice.post("/api/v1/forward_backward", content=body, headers=PROTO), param)


def test_a_zstd_bomb_is_413_after_its_first_megabyte(alice):
    bomb = zstandard.ZstdCompressor(level=19).compress(b"\0" * (16 << 20))
    assert len(bomb) < 1024
    headers = {**PROTO, "content-encoding": "zstd"}
    _refused(alice.post("/api/v1/forward_backward", content=bomb, headers=headers), "body", 413)
    # it is read as a stream that stops at its cap: a 256 MiB bomb never takes more than a few MiB
    writer = zstandard.ZstdCompressor().compressobj()
    big = b"".join(writer.compress(b"\0" * (1 << 20)) for _ in range(256)) + writer.flush()
    tracemalloc.start()
    try:
        with pytest.raises(TinkerError) as err:
            decompressed(big, 128 << 20)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert err.value.status == 413 and peak < 4 * FLOOR_BYTES + len(big), peak


def test_healthz_answers_while_a_slow_body_is_decoded(svc, alice):
    """200k small datums take the reader seconds, datum by datum (the last is an image chunk, refused);
    /healthz meanwhile answers in a small part of that (the body is decoded in a worker thread, not
    on the event loop)."""
    datum = _len(3, _len(1, _len(1, _len(1, struct.pack("<4i", 1, 2, 3, 4)))))
    slow = MODEL + datum * 200_000 + _len(3, _len(1, _len(2, b"")))
    took: dict[str, float] = {}

    def send() -> None:
        start = time.monotonic()
        took["status"] = alice.post("/api/v1/forward_backward", content=slow, headers=PROTO).status_code
        took["body"] = time.monotonic() - start

    thread = threading.Thread(target=send)
    thread.start()
    time.sleep(0.3)
    waits = []
    with httpx.Client(base_url=svc.url, timeout=60) as client:
        while thread.is_alive() and len(waits) < 50:
            start = time.monotonic()
            assert client.get("/healthz").status_code == 200
            waits.append(time.monotonic() - start)
            time.sleep(0.05)
    thread.join(120)
    assert took["status"] == 400 and waits, took  # data[200000].model_input: text only
    # the median: a loop blocked by the decode answers once, after it; one slow answer is a busy machine
    assert sorted(waits)[len(waits) // 2] < took["body"] / 4, (waits, took)


def test_a_5000_digit_integer_in_a_job_body_is_422(svc):
    body = ('{"method": "grpo", "trainer": {"total_steps": ' + "9" * 5000 + "}}").encode()
    with svc.client() as admin:
        got = admin.post("/v1/jobs", content=body, headers={"content-type": "application/json"})
        assert got.status_code == 422, got.text
        assert got.json()["error"]["param"] == "body"
        assert admin.post("/v1/jobs", json=tiny_job(trainer={"total_steps": 10**30})).status_code == 422


def test_an_unexpected_error_answers_500_in_the_error_shape_with_its_request_id(svc, alice, monkeypatch):
    tinker = svc.server.config.app.state.tinker

    def broken() -> dict:
        raise RuntimeError("a fault injected by the test")

    monkeypatch.setattr(tinker, "capabilities", broken)
    got = alice.get("/api/v1/get_server_capabilities", headers={"x-request-id": "req-probe-1"})
    assert got.status_code == 500 and got.headers["x-request-id"] == "req-probe-1"
    assert got.json()["category"] == "server" and "req-probe-1" in got.json()["error"]
    monkeypatch.setattr(svc.service, "get", lambda *a, **k: broken())
    with svc.client() as admin:
        plain = admin.get("/v1/jobs/job-x", headers={"x-request-id": "req-probe-2"})
    assert plain.status_code == 500, plain.text
    error = plain.json()["error"]
    assert error["type"] == "server_error" and "req-probe-2" in error["message"]


def test_an_owner_with_too_many_unanswered_requests_gets_a_429_the_sdk_retries(svc):
    """Each queued op holds its body until dispatched: past the bound the owner is told to back off (a 429,
    which the SDK retries); a cancelled op still queued counts, and another owner is not held back."""
    keys = owner_keys(svc, ("carol", "dave"))
    with httpx.Client(base_url=svc.url, timeout=60) as http:
        models = {}
        for owner, key in keys.items():
            http.headers["X-API-Key"] = key
            session = http.post("/api/v1/create_session", json={}).json()["session_id"]
            made = http.post(
                "/api/v1/create_model",
                json={
                    "session_id": session,
                    "base_model": BASE,
                    "model_seq_id": 0,
                    "lora_config": {"rank": 4},
                },
            )
            assert made.status_code == 200, made.text
            models[owner] = f"{session}:train:0"
        http.headers["X-API-Key"] = keys["carol"]
        step = {"model_id": models["carol"]}
        queued = [http.post("/api/v1/optim_step", json=step) for _ in range(PENDING - 1)]  # and its creation
        assert all(r.status_code == 200 for r in queued), [r.text for r in queued]
        http.post("/api/v1/cancel_future", json={"request_id": queued[0].json()["request_id"]})
        refused = _refused(http.post("/api/v1/optim_step", json=step), "tinker_max_pending_requests", 429)
        assert str(PENDING) in refused["error"]
        targets = {"target_tokens": {"data": [2, 3], "dtype": "int64"}, "weights": {"data": [1.0, 1.0]}}
        fwd = _fwd({**_chunks([1, 2]), "loss_fn_inputs": targets}, model_id=models["carol"])
        _refused(http.post("/api/v1/forward_backward", json=fwd), "tinker_max_pending_requests", 429)
        http.headers["X-API-Key"] = keys["dave"]
        assert http.post("/api/v1/optim_step", json={"model_id": models["dave"]}).status_code == 200


def test_an_owners_samplers_are_bounded_and_end_with_their_session(svc, monkeypatch):
    """A sampler costs its owner one cheap request: the oldest beyond the bound go, and a session's go
    when it ends (before, they stayed for the life of the service)."""
    from service import tinker_sessions

    monkeypatch.setattr(tinker_sessions, "MAX_SAMPLERS", 3, raising=False)
    tinker_svc = svc.server.config.app.state.tinker
    with httpx.Client(base_url=svc.url, headers={"X-API-Key": owner_keys(svc, ("erin",))["erin"]}) as erin:
        session = erin.post("/api/v1/create_session", json={}).json()["session_id"]
        made = [erin.post("/api/v1/create_sampling_session", json={"session_id": session, "base_model": BASE})
                .json()["sampling_session_id"] for _ in range(5)]  # fmt: skip
        seen = [erin.get(f"/api/v1/samplers/{sampler}").status_code for sampler in made]
        assert seen == [404, 404, 200, 200, 200], seen
        tinker_svc.records.sessions[session].last_heartbeat -= tinker_svc.session_ttl_s + 1  # silent since
        erin.post("/api/v1/create_session", json={})  # which ends it
        assert erin.get(f"/api/v1/samplers/{made[-1]}").status_code == 404


def test_a_datum_without_tokens_is_400_naming_it(svc):
    """The host could not lay it out (a torch error as the service's own): refused before it is queued."""
    with httpx.Client(base_url=svc.url, headers={"X-API-Key": owner_keys(svc, ("gus",))["gus"]}) as gus:
        session = gus.post("/api/v1/create_session", json={}).json()["session_id"]
        made = gus.post(
            "/api/v1/create_model", json={"session_id": session, "base_model": BASE, "model_seq_id": 0}
        )
        assert made.status_code == 200, made.text
        empty = {"target_tokens": {"data": [], "dtype": "int64"}, "weights": {"data": []}}
        for chunks in ([], [{"tokens": []}]):
            datum = {"model_input": {"chunks": chunks}, "loss_fn_inputs": empty}
            full = {"target_tokens": {"data": [2], "dtype": "int64"}, "weights": {"data": [1.0]}}
            body = _fwd({**_chunks([1]), "loss_fn_inputs": full}, model_id=f"{session}:train:0")
            body["forward_backward_input"]["data"].append(datum)
            _refused(
                gus.post("/api/v1/forward_backward", json=body), "forward_backward_input.data[1].model_input"
            )


def test_a_read_answer_is_dropped_soon_and_an_unread_one_is_kept(alice, ids, svc, monkeypatch):
    """A forward's answer may be megabytes: once read it stays READ_KEEP_S (a lost reply's retry), not an hour."""
    from service import tinker_sessions

    monkeypatch.setattr(tinker_sessions, "READ_KEEP_S", 0.0, raising=False)
    monkeypatch.setattr(tinker_sessions, "SWEEP_EVERY_S", 0.0)
    futures = svc.server.config.app.state.tinker.futures

    def sample() -> str:  # its host cannot start: it fails at once, a finished future all the same
        request_id = alice.post("/api/v1/asample", json={"sampling_session_id": ids["sampler"], **SAMPLE})
        request_id = request_id.json()["request_id"]
        deadline = time.time() + 30
        while not futures[request_id].done and time.time() < deadline:
            time.sleep(0.01)
        return request_id

    read, unread = sample(), sample()
    assert alice.post("/api/v1/retrieve_future", json={"request_id": read}).json()["category"] == "server"
    time.sleep(0.01)
    sample()  # a new future sweeps the table
    _refused(alice.post("/api/v1/retrieve_future", json={"request_id": read}), "request_id", 404)
    assert alice.post("/api/v1/retrieve_future", json={"request_id": unread}).json()["category"] == "server"


def test_a_sampler_save_under_a_saved_name_is_refused_not_overwritten(svc):
    """The SDK's save_weights_for_sampler has no `overwrite` (save_state has): a second save of a name
    would silently replace the first checkpoint under the samplers and downloads already using it."""
    from service.tinker_checkpoints import checkpoint_folder, commit

    tinker_svc = svc.server.config.app.state.tinker
    with httpx.Client(base_url=svc.url, headers={"X-API-Key": owner_keys(svc, ("hal",))["hal"]}) as hal:
        session = hal.post("/api/v1/create_session", json={}).json()["session_id"]
        made = hal.post(
            "/api/v1/create_model", json={"session_id": session, "base_model": BASE, "model_seq_id": 0}
        )
        assert made.status_code == 200, made.text
        model = tinker_svc.records.models[f"{session}:train:0"]
        folder = checkpoint_folder(model.workdir, "sampler_weights", "best")  # as a first save leaves it
        commit(
            svc.service.store, model.job_id, folder, f"tinker://{model.job_id}/sampler_weights/best", None, ""
        )
        body = {"model_id": model.model_id, "path": "best"}
        refused = _refused(hal.post("/api/v1/save_weights_for_sampler", json=body), "path")
        assert "best" in refused["error"]
        assert hal.post("/api/v1/save_weights_for_sampler", json={**body, "path": "other"}).status_code == 200


def test_tinker_auth_login_reads_a_key_and_logout_revokes_it(svc):
    """The SDK's `tinker auth login` checks a pasted key with GET /auth/apikey/me, and `logout` revokes it
    with DELETE; both were refused as unsupported, so an owner could not revoke a leaked key of theirs."""
    from tinker.cli.auth_api import AuthApiError, TinkerAuthApi

    key = owner_keys(svc, owners=("carol",))["carol"]
    with httpx.Client(timeout=30) as http, svc.client() as admin:
        auth = TinkerAuthApi(http, base_url=svc.url)
        me = auth.get_self_api_key(key)  # the SDK's own response model checks the shape
        key_id = f"key-{me.key_id:012x}"

        def record() -> dict:  # the module's other tests may hold keys of carol's too
            return {k["id"]: k for k in admin.get("/v1/keys", params={"owner": "carol"}).json()["data"]}[
                key_id
            ]

        assert me.details.user_details.email == "carol" and record()["revoked_at"] is None
        auth.delete_self_api_key(key)
        assert record()["revoked_at"] is not None
        with pytest.raises(AuthApiError, match="HTTP 401"):
            auth.get_self_api_key(key)
        got = http.delete(svc.url + "/api/v1/auth/apikey/me", headers={"X-API-Key": svc.token})
        assert got.status_code == 400 and "TANDEM_ADMIN_TOKEN" in got.json()["error"]
