"""What tinker-cookbook needs of the Tinker API beyond the loops' basics, with the official SDK against a
real service and session host: samples recorded for stable_reinforce, checkpoint deletion and TTLs,
external weights behind signed URLs (the cookbook's `weights.download`), a run's user_metadata, a base
model served under its folder (the cookbook's `get_tokenizer`), and long polls answered while other
requests wait on the service. One service per module."""

from __future__ import annotations

import math
import threading
import time
import urllib.request
from pathlib import Path

import httpx
import pytest

pytest.importorskip("tinker")
pytest.importorskip("workers.session_host")
import tinker  # noqa: E402
from tinker import types  # noqa: E402

from api.routes.tinker import LONG_POLL_S  # noqa: E402
from tests.tinker_loops import owner_keys, point_sdk, served, service_client  # noqa: E402

BASE = "tiny-qwen2"


@pytest.fixture(scope="module")
def svc(ray_cluster, tmp_path_factory):
    yield from served(tmp_path_factory, "tinker-cookbook", [BASE])


@pytest.fixture(scope="module")
def keys(svc):
    return owner_keys(svc)


@pytest.fixture
def sdk(svc, keys, monkeypatch):
    point_sdk(monkeypatch, svc.url, keys["alice"])
    return service_client()


@pytest.fixture(scope="module")
def trained(svc, keys):
    """A training client of alice's (made once: the host starts with it)."""
    with pytest.MonkeyPatch.context() as mp:
        point_sdk(mp, svc.url, keys["alice"])
        return service_client().create_lora_training_client(base_model=BASE, rank=4, seed=0).result()


def rest(svc, key: str) -> tinker.RestClient:
    return tinker.RestClient(base_url=svc.url, api_key=key)


def names(svc, key: str, run: str) -> list[str]:
    return [c.checkpoint_id for c in rest(svc, key).list_checkpoints(run).result().checkpoints]


def provenance_datum(
    seq: types.SampledSequence,
    prompt: list[int],
    logprobs: list[float] | None,
    sampled: list[int] | None = None,
) -> types.Datum:
    """The cookbook's RL datum: input and targets shifted by one, each position naming where it came from."""
    tokens, sid, n = prompt + (sampled or list(seq.tokens)), seq.sequence_id, len(prompt)
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "advantages": [0.0] * (n - 1) + [1.0] * len(seq.tokens),
                        "logprobs": [0.0] * (n - 1) + list(logprobs if logprobs is not None else seq.logprobs)},
    )  # fmt: skip
    return datum.with_provenance(
        model_input=[types.PromptProvenanceSpan(sequence_id=sid, offset=0, length=n),
                     types.SampledProvenanceSpan(sequence_id=sid, offset=0, length=len(seq.tokens) - 1)],
        loss_fn_inputs=[types.PromptProvenanceSpan(sequence_id=sid, offset=1, length=n - 1),
                        types.SampledProvenanceSpan(sequence_id=sid, offset=0, length=len(seq.tokens))],
    )  # fmt: skip


def test_stable_reinforce_trains_on_the_samples_recorded_with_stability_info(svc, sdk, trained):
    prompt = [5, 6, 7, 8]
    params = types.SamplingParams(max_tokens=6, temperature=1.0, seed=3)
    recording = trained.save_weights_and_get_sampling_client(record_stability_info=True).result()
    seq = recording.sample(types.ModelInput.from_ints(prompt), 1, params).result().sequences[0]
    assert seq.sequence_id and len(seq.tokens) > 1

    def loss(datum: types.Datum) -> float:
        return trained.forward([datum], "stable_reinforce").result().metrics["loss:sum"]

    true_loss = loss(provenance_datum(seq, prompt, None))
    # the sampler's recorded log-probs stand in for whatever the client sends under its spans
    assert math.isclose(
        loss(provenance_datum(seq, prompt, [-9.0] * len(seq.tokens))), true_loss, rel_tol=1e-6
    )
    plain = provenance_datum(seq, prompt, [-9.0] * len(seq.tokens))
    plain = types.Datum(model_input=plain.model_input, loss_fn_inputs=plain.loss_fn_inputs)
    assert not math.isclose(loss(plain), true_loss, rel_tol=1e-6)  # without spans: the datum's own

    unrecorded = trained.save_weights_and_get_sampling_client().result()
    other = unrecorded.sample(types.ModelInput.from_ints(prompt), 1, params).result().sequences[0]
    with pytest.raises(
        tinker.BadRequestError, match=r"model_input_spans\[0\].sequence_id.*record_stability_info"
    ):
        loss(provenance_datum(other, prompt, None))
    with pytest.raises(tinker.BadRequestError, match=r"model_input_spans\[1\]: positions"):
        loss(provenance_datum(seq, prompt, None, [t ^ 1 for t in seq.tokens]))


def test_checkpoints_are_deleted_by_their_owner_and_expire_after_their_ttl(svc, keys, sdk, trained):
    run = trained.save_state("keep").result().path.split("/")[2]
    trained.save_state("gone").result()
    trained.save_state("ttl").result()
    alice, bob = rest(svc, keys["alice"]), rest(svc, keys["bob"])
    assert {"weights/keep", "weights/gone", "weights/ttl"} <= set(names(svc, keys["alice"], run))

    with pytest.raises(tinker.NotFoundError):  # another owner's: unknown to bob, and it stays
        bob.delete_checkpoint_from_tinker_path(f"tinker://{run}/weights/gone").result()
    alice.delete_checkpoint_from_tinker_path(f"tinker://{run}/weights/gone").result()
    assert "weights/gone" not in names(svc, keys["alice"], run)
    with pytest.raises(tinker.NotFoundError):
        service_client().create_training_client_from_state(f"tinker://{run}/weights/gone").result()

    alice.set_checkpoint_ttl_from_tinker_path(f"tinker://{run}/weights/ttl", 3600).result()
    listed = {c.checkpoint_id: c for c in alice.list_checkpoints(run).result().checkpoints}
    assert listed["weights/ttl"].expires_at is not None and listed["weights/keep"].expires_at is None
    alice.set_checkpoint_ttl_from_tinker_path(f"tinker://{run}/weights/ttl", None).result()
    assert {c.checkpoint_id: c for c in alice.list_checkpoints(run).result().checkpoints}[
        "weights/ttl"
    ].expires_at is None

    # expired, an unlooked-at checkpoint still counts in its owner's stored bytes until it is swept
    tinker_svc = svc.server.config.app.state.tinker
    tinker_svc._reaped = time.time()  # no heartbeat's sweep in the next minute
    trained.save_state("short", ttl_seconds=1).result()
    short = Path(svc.service.store.get_job(run).workdir, "checkpoints", "weights", "short")
    time.sleep(1.2)
    before = svc.service.usage("alice").stored["checkpoints"]
    assert short.is_dir()
    tinker_svc._reaped = 0.0
    tinker_svc.expire_sessions()  # the sweep heartbeats run
    assert not short.exists() and svc.service.usage("alice").stored["checkpoints"] < before
    assert "weights/short" not in names(svc, keys["alice"], run)


def test_external_weights_download_through_signed_urls_and_the_cookbooks_download(
    svc, keys, sdk, trained, tmp_path
):
    saved = trained.save_weights_external("export", ttl_seconds=3600).result()
    run = saved.path.split("/")[2]
    urls = rest(svc, keys["alice"]).get_external_weights_urls(saved.path).result()
    assert sorted(urls.urls) == ["adapter_config.json", "adapter_model.safetensors"]
    data = urllib.request.urlopen(urls.urls["adapter_model.safetensors"], timeout=30).read()  # no key
    assert len(data) > 100
    forged = urls.urls["adapter_model.safetensors"].replace("signature=", "signature=0")
    assert httpx.get(forged, timeout=30).status_code == 404
    with pytest.raises(tinker.NotFoundError):
        rest(svc, keys["bob"]).get_external_weights_urls(saved.path).result()

    weights = pytest.importorskip("tinker_cookbook.weights")
    state = trained.save_state("for-download").result().path
    out = weights.download(tinker_path=state, output_dir=str(tmp_path / "adapter"))
    assert sorted(p.name for p in Path(out).iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    assert "external_weights/export" in names(svc, keys["alice"], run)
    exports = [c for r in rest(svc, keys["alice"]).list_training_runs(limit=100).result().training_runs
               for c in names(svc, keys["alice"], r.training_run_id) if c == "external_weights/download"]  # fmt: skip
    assert exports == []  # the download deleted its temporary export


def test_user_metadata_given_at_creation_comes_back_with_the_run(svc, keys, sdk):
    tc = sdk.create_lora_training_client(
        base_model=BASE, rank=2, user_metadata={"renderer_name": "role_colon"}
    )
    run = tc.result().save_state("m").result().path.split("/")[2]
    got = rest(svc, keys["alice"]).get_training_run(run).result().user_metadata
    assert got["renderer_name"] == "role_colon"
    with httpx.Client(base_url=svc.url, headers={"X-API-Key": keys["alice"]}, timeout=30) as http:
        session = http.post("/api/v1/create_session", json={"tags": []}).json()["session_id"]
        bad = http.post("/api/v1/create_model", json={"session_id": session, "model_seq_id": 9, "base_model": BASE,
                                                      "user_metadata": {"n": 5}})  # fmt: skip
    assert bad.status_code == 400 and bad.json()["param"] == "user_metadata.n"


def test_a_built_in_base_is_served_under_its_folder_which_get_tokenizer_loads_offline(svc, sdk, monkeypatch):
    from controller.models import builtin_model_path

    folder = str(builtin_model_path(BASE, svc.service.home))  # what `tandem models build` prints
    assert folder in [m.model_name for m in sdk.get_server_capabilities().supported_models]
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    tok_utils = pytest.importorskip("tinker_cookbook.tokenizer_utils")
    assert tok_utils.get_tokenizer(folder).encode("1+1=", add_special_tokens=False)
    tc = sdk.create_lora_training_client(base_model=folder, rank=2).result()
    assert tc.get_info().model_data.model_name == BASE


def test_a_long_poll_answers_try_again_while_another_request_waits_on_the_service(svc, keys, sdk, trained):
    tinker_svc = svc.server.config.app.state.tinker
    pending = tinker_svc.futures.create("alice", "test")
    blocked = threading.Thread(
        target=lambda: sdk.create_lora_training_client(base_model=BASE, rank=2).result()
    )
    with svc.service.admitting():  # a create_model now waits on the admission lock
        blocked.start()
        time.sleep(1.0)
        started = time.monotonic()
        with httpx.Client(
            base_url=svc.url, headers={"X-API-Key": keys["alice"]}, timeout=LONG_POLL_S + 5
        ) as http:
            answer = http.post("/api/v1/retrieve_future", json={"request_id": pending.id}).json()
        assert answer == {"type": "try_again", "request_id": pending.id, "queue_state": "active"}
        assert time.monotonic() - started < 45  # the SDK's read timeout for a retrieve_future
    blocked.join(timeout=120)
    tinker_svc.futures.finish(pending, {})


def test_hostile_checkpoint_requests_are_4xx_naming_the_field(svc, keys, sdk, trained):
    run = trained.save_state("hostile").result().path.split("/")[2]
    base = f"/api/v1/training_runs/{run}/checkpoints"
    with httpx.Client(base_url=svc.url, headers={"X-API-Key": keys["alice"]}, timeout=30) as http:
        for ttl, param in (
            (0, "ttl_seconds"),
            (-1, "ttl_seconds"),
            ("1h", "ttl_seconds"),
            (2**70, "ttl_seconds"),
        ):
            answer = http.put(f"{base}/weights/hostile/ttl", json={"ttl_seconds": ttl})
            assert answer.status_code == 400 and answer.json()["param"] == param, answer.text
        for path in ("weights/..", "weights/.complete", "bogus/hostile", "sampler_weights/hostile"):
            answer = http.delete(f"{base}/{path}")
            assert answer.status_code in (400, 404) and "error" in answer.json(), (path, answer.text)
        sid = http.post("/api/v1/create_session", json={"tags": []}).json()["session_id"]
        model = http.post(
            "/api/v1/create_model", json={"session_id": sid, "model_seq_id": 0, "base_model": BASE}
        ).json()
        for body, param in (
            ({"path": "../x"}, "path"),
            ({"path": "x", "ttl_seconds": 0}, "ttl_seconds"),
            ({"path": "x", "age_encryption_recipients": ["not-a-key"]}, "age_encryption_recipients[0]"),
        ):
            answer = http.post("/api/v1/save_weights_external", json={"model_id": f"{sid}:train:0", **body})
            assert answer.status_code == 400 and answer.json()["param"] == param, answer.text
        assert model["request_id"]
    for query in (
        "expires=1&signature=00",
        "expires=99999999999999999999999&signature=00",
        "expires=x&signature=0",
    ):
        answer = httpx.get(
            f"{svc.url}/api/v1/external_weights/{run}/n/adapter_config.json?{query}", timeout=30
        )
        assert 400 <= answer.status_code < 500, answer.text
    assert "weights/hostile" in names(svc, keys["alice"], run)


def test_a_dropped_samplers_snapshot_leaves_the_hosts_disk_and_a_named_one_stays(svc, keys, monkeypatch):
    """An RL loop saves a snapshot a step: one whose sampler is dropped (here beyond the owner's bound of
    one) is deleted after its queued samples; a named one is a checkpoint and stays."""
    from service import tinker_sessions

    monkeypatch.setattr(tinker_sessions, "MAX_SAMPLERS", 1)
    point_sdk(monkeypatch, svc.url, keys["bob"])
    training = service_client().create_lora_training_client(base_model=BASE, rank=4, seed=0).result()
    samplers = svc.server.config.app.state.tinker.records.samplers

    def save(name: str | None = None) -> Path:
        if name is None:
            training.save_weights_and_get_sampling_client().result()
        else:
            training.save_weights_for_sampler(name).result()
        [sampler] = samplers.of("bob")
        assert Path(sampler.path).is_dir()
        return Path(sampler.path)

    def gone(folder: Path) -> bool:
        deadline = time.time() + 60
        while folder.exists() and time.time() < deadline:
            time.sleep(0.05)
        return not folder.exists()

    unnamed = save()
    named = save("kept")
    assert gone(unnamed)
    third = save()  # the named one's sampler is dropped
    save()
    assert gone(third) and named.is_dir()  # a drop of the named one would have run before the third's


def test_a_named_sampler_snapshot_counts_in_its_owners_stored_bytes_and_goes_with_its_checkpoint(
    svc, keys, sdk, trained
):
    from service.quotas import folder_bytes

    before = svc.service.usage("alice").stored["checkpoints"]
    path = trained.save_weights_for_sampler("counted").result().path
    [sampler] = [
        s for s in svc.server.config.app.state.tinker.records.samplers.of("alice") if s.tinker_path == path
    ]
    snapshot = folder_bytes(Path(sampler.path))
    assert snapshot > 1000 and svc.service.usage("alice").stored["checkpoints"] - before >= snapshot
    rest(svc, keys["alice"]).delete_checkpoint_from_tinker_path(path).result()
    assert not Path(sampler.path).exists()


def test_a_save_past_the_owners_stored_bytes_is_403_naming_the_quota(svc, monkeypatch):
    """The quota was checked when the model was made only: its saves could then fill the disk."""
    key = owner_keys(svc, ("carol",))["carol"]
    with svc.client() as admin:
        assert admin.put("/v1/quotas/carol", json={"stored_bytes": 1}).status_code == 200
    point_sdk(monkeypatch, svc.url, key)
    training = service_client().create_lora_training_client(base_model=BASE, rank=4, seed=0).result()
    training.save_state("first").result()  # from nothing: past the quota only once saved
    for save in (training.save_state, training.save_weights_for_sampler, training.save_weights_external):
        with pytest.raises(tinker.PermissionDeniedError, match="quota stored_bytes"):
            save("more").result()
    training.save_weights_and_get_sampling_client().result()  # an unnamed sampler is no checkpoint
