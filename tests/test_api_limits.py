"""User code, limits, uploads and server paths against a live service with tight settings: a reward
reference that exits, hangs or ends its process on import is a 422 naming the field and the service
stays up (the API never imports it); bodies over the limit are 413; metadata over its limits is 422,
nothing stored; uploaded files are referenced by id; server paths outside the allowed roots are
refused alike whether they exist or not."""

from __future__ import annotations

import httpx
import pytest

from api.settings import ServeSettings
from controller.user_code import check_callable
from tests.api_util import start_service, tiny_job, wait_for

SAMPLES = "tests.user_code_samples"
TIMEOUT_S = 8.0


@pytest.fixture(scope="module")
def live(ray_cluster, tmp_path_factory):
    monkey = pytest.MonkeyPatch()
    monkey.setenv("TANDEM_HOME", str(tmp_path_factory.getbasetemp() / "home"))
    settings = ServeSettings(
        max_body_bytes=64 * 1024, metadata_max_keys=3, metadata_max_key_chars=8, metadata_max_value_chars=20,
        user_code_timeout_s=TIMEOUT_S, max_upload_bytes=256 * 1024,
    )  # fmt: skip
    svc = start_service(tmp_path_factory.mktemp("service"), settings=settings)
    yield svc
    svc.stop()
    monkey.undo()


def _refused(response: httpx.Response, status: int, param: str) -> str:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param, error
    return error["message"]


BAD_REWARDS = [
    ("venv.__main__:main", "SystemExit"),
    (f"{SAMPLES}.exits_on_import:score", "did not finish: the sandbox's process ended (exit code 3)"),
    (f"{SAMPLES}.hangs_on_import:score", f"did not finish within {TIMEOUT_S:g} s"),
]


@pytest.mark.parametrize("ref,why", BAD_REWARDS)
def test_a_reward_that_misbehaves_on_import_is_422_and_the_service_stays_up(live, api, ref, why):
    before = len(api.get("/v1/jobs").json()["data"])
    message = _refused(api.post("/v1/jobs", json=tiny_job(reward={"function": ref})), 422, "reward.function")
    assert why in message and ref in message
    body = {"function": ref, "rows": [{"response": "1"}]}
    assert why in _refused(api.post("/v1/rewards/validate", json=body), 422, "function")
    assert httpx.get(live.url + "/healthz").status_code == 200 and live.service.is_alive
    assert len(api.get("/v1/jobs").json()["data"]) == before


def test_a_reward_that_hangs_when_scoring_is_cut_off(api):
    body = {"function": f"{SAMPLES}.hangs_when_called:score", "rows": [{"response": "1"}]}
    assert "did not finish" in _refused(api.post("/v1/rewards/validate", json=body), 422, "function")


def test_reward_scores_come_back_from_the_sandbox(api):
    body = {"function": "tests.reward_fns:digit_reward", "rows": [{"response": "12ab"}, {"response": "xx"}]}
    scored = api.post("/v1/rewards/validate", json=body)
    assert scored.status_code == 200, scored.text
    assert scored.json()["scores"] == [0.5, 0.0] and scored.json()["metrics"]["reward/digits/mean"] == 1.0


def test_user_code_checks_run_in_a_sandbox():
    assert check_callable("tests.reward_fns:digit_reward", "reward", 30) is None
    assert "SystemExit" in check_callable("venv.__main__:main", "reward", 30)
    assert "expected (prompt, response" in check_callable("os:getcwd", "reward", 30)
    with pytest.raises(KeyError):
        check_callable("os:getcwd", "nonsense", 30)


def test_an_oversized_body_is_413_declared_or_streamed(live, api):
    big = tiny_job(metadata={"k": "x" * 100_000})
    assert "limit" in _refused(api.post("/v1/jobs", json=big), 413, "body")

    def chunks():
        yield b'{"method": "grpo", "metadata": {"k": "'
        for _ in range(100):
            yield b"x" * 1024
        yield b'"}}'

    streamed = api.post("/v1/jobs", content=chunks(), headers={"content-type": "application/json"})
    _refused(streamed, 413, "body")
    assert api.get("/v1/jobs").status_code == 200


@pytest.mark.parametrize(
    "metadata,param",
    [
        ({"a": "1", "b": "2", "c": "3", "d": "4"}, "metadata"),
        ({"a" * 9: "1"}, "metadata"),
        ({"k": "v" * 21}, "metadata.k"),
    ],
)
def test_metadata_over_its_limits_is_422_and_nothing_is_stored(api, metadata, param):
    before = len(api.get("/v1/jobs").json()["data"])
    _refused(api.post("/v1/jobs", json=tiny_job(metadata=metadata)), 422, param)
    assert len(api.get("/v1/jobs").json()["data"]) == before


REWARD_PY = b"""
def score(prompt, response, ground_truth, extra):
    return float(str(ground_truth) in response)
"""
ROWS = b"".join(b'{"prompt": "%d+1=", "ground_truth": "%d"}\n' % (i, i + 1) for i in range(8))


def _upload(api: httpx.Client, name: str, content: bytes) -> httpx.Response:
    return api.post("/v1/files", params={"filename": name}, content=content,
                    headers={"content-type": "application/octet-stream"})  # fmt: skip


def test_uploaded_files_are_listed_used_by_id_and_deleted(api):
    data = _upload(api, "train.jsonl", ROWS)
    code = _upload(api, "my_reward.py", REWARD_PY)
    assert data.status_code == code.status_code == 201, (data.text, code.text)
    data_id, code_id = data.json()["id"], code.json()["id"]
    assert data.json()["bytes"] == len(ROWS) and data.json()["purpose"] == "data"
    assert {data_id, code_id} <= {f["id"] for f in api.get("/v1/files").json()["data"]}
    assert api.get(f"/v1/files/{code_id}").json()["filename"] == "my_reward.py"
    scored = api.post("/v1/rewards/validate", json={"function": f"{code_id}:score",
                                                    "rows": [{"response": "5", "ground_truth": 5}]})  # fmt: skip
    assert scored.status_code == 200 and scored.json()["scores"] == [1.0], scored.text
    spec = tiny_job(data={"train_path": data_id, "builtin_task": None}, reward={"function": f"{code_id}:score"},
                    trainer={"total_steps": 1}, checkpoint={"every": 0})  # fmt: skip
    created = api.post("/v1/jobs", json=spec)
    assert created.status_code == 201, created.text
    assert created.json()["spec"]["data"]["train_path"] == data_id  # the spec keeps the id
    job = wait_for(api, created.json()["id"], ("succeeded", "failed", "cancelled"))
    assert job["status"] == "succeeded", job["error"]
    assert api.delete(f"/v1/files/{data_id}").json()["deleted"] is True
    assert _refused(api.get(f"/v1/files/{data_id}"), 404, "file_id")
    _refused(api.post("/v1/jobs", json=spec), 422, "data.train_path")


def test_uploads_are_checked_and_size_limited(api):
    _refused(_upload(api, "../evil.py", b"x"), 422, "filename")
    _refused(_upload(api, "notes.txt", b"x"), 422, "filename")
    _refused(_upload(api, "empty.jsonl", b""), 422, "body")
    _refused(_upload(api, "big.jsonl", b"x" * (300 * 1024)), 413, "body")
    names = [f["filename"] for f in api.get("/v1/files").json()["data"]]
    assert not {"empty.jsonl", "big.jsonl"} & set(names)


@pytest.mark.parametrize(
    "patch,param",
    [
        ({"data": {"train_path": "/etc/passwd"}}, "data.train_path"),
        ({"data": {"train_path": "/etc/no-such-file.jsonl"}}, "data.train_path"),
        ({"checkpoint": {"resume_from": "/etc"}}, "checkpoint.resume_from"),
        ({"model": {"builtin": None, "path": "/usr"}}, "model.path"),
        ({"reward": {"function": "/etc/passwd.py:f"}}, "reward.function"),
    ],
)
def test_server_paths_outside_the_allowed_roots_are_refused_alike(api, patch, param):
    message = _refused(api.post("/v1/jobs", json=tiny_job(**patch)), 422, param)
    assert "is not in your uploads, your jobs' outputs or a folder this service shares" in message
    assert "exist" not in message and "no file" not in message


def test_the_cli_uploads_lists_and_deletes_files(live, api, tmp_path):
    from tests.test_cli import tandem

    data = tmp_path / "rows.jsonl"
    data.write_bytes(ROWS)
    uploaded = tandem(live, "files", "upload", str(data))
    assert uploaded.returncode == 0, uploaded.stderr
    file_id = uploaded.stdout.split()[0]
    assert api.get(f"/v1/files/{file_id}").json()["bytes"] == len(ROWS)
    assert file_id in tandem(live, "files", "list").stdout
    assert tandem(live, "files", "delete", file_id).returncode == 0
    assert api.get(f"/v1/files/{file_id}").status_code == 404
