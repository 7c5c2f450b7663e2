"""POST /v1/files with multipart/form-data (`curl -F file=@train.jsonl`) against a live service.

The form's one file field is streamed to the file store under the same size limit and checks as a
raw upload; every bad form is a 4xx naming the field at fault, and nothing of it is stored. The
service runs without its scheduler (no Ray): uploads need none.
"""

from __future__ import annotations

import json
import subprocess

import httpx
import pytest

from api.settings import ServeSettings
from tests.api_util import start_service

pytest.importorskip("python_multipart")

LIMIT = 64 * 1024
ROWS = b"".join(b'{"prompt": "%d+1=", "ground_truth": "%d"}\n' % (i, i + 1) for i in range(400))


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    svc = start_service(tmp_path_factory.mktemp("upload-form"), schedule=False,
                        settings=ServeSettings(max_upload_bytes=LIMIT))  # fmt: skip
    yield svc
    svc.stop()


@pytest.fixture
def api(live):
    with live.client() as http:
        yield http


def stored(live, file_id: str) -> bytes:
    record = live.service.files.get(file_id)
    return live.service.files.path(record.id).read_bytes()


def refused(response: httpx.Response, status: int, param: str) -> str:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param, error
    assert status == 413 or error["message"].startswith(param + ":"), error  # 4xx messages lead with it
    return error["message"]


def file_names(api: httpx.Client) -> list[str]:
    return [f["filename"] for f in api.get("/v1/files").json()["data"]]


def test_curl_form_upload_is_stored_byte_for_byte(live, tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_bytes(ROWS)
    assert 16 * 1024 < len(ROWS) < LIMIT  # more than one chunk of the body
    done = subprocess.run(["curl", "-sS", "-H", f"Authorization: Bearer {live.token}", "-F", f"file=@{path}",
                           f"{live.url}/v1/files"], capture_output=True, timeout=60)  # fmt: skip
    assert done.returncode == 0, done.stderr
    record = json.loads(done.stdout)
    assert (record["filename"], record["bytes"], record["purpose"]) == ("train.jsonl", len(ROWS), "data")
    assert stored(live, record["id"]) == ROWS


def test_a_form_upload_keeps_binary_content_and_takes_a_name_from_the_query(live, api):
    content = bytes(range(256)) * 40 + b"\r\n--not-the-boundary\r\n"  # boundary-like bytes inside
    sent = api.post("/v1/files", files={"file": ("blob.bin", content)}, params={"filename": "rows.parquet"})
    assert sent.status_code == 201, sent.text
    assert (sent.json()["filename"], sent.json()["purpose"]) == ("rows.parquet", "data")
    assert stored(live, sent.json()["id"]) == content


def test_a_form_over_the_upload_limit_is_413_and_not_stored(api):
    before = file_names(api)
    big = api.post("/v1/files", files={"file": ("big.jsonl", b"x" * (LIMIT + 1))})
    refused(big, 413, "body")
    assert file_names(api) == before


@pytest.mark.parametrize(
    "form,status,param",
    [
        ({"files": {"data": ("a.jsonl", b"{}\n")}}, 422, "data"),  # the file under another field's name
        ({"files": {"file": (None, b"not a file")}}, 422, "file"),  # a plain field, no file name
        ({"files": [("file", ("a.jsonl", b"{}\n")), ("file", ("b.jsonl", b"{}\n"))]}, 422, "file"),
        ({"files": {"file": ("empty.jsonl", b"")}}, 422, "file"),
        ({"files": {"file": ("notes.txt", b"hello")}}, 422, "filename"),
        ({"files": {"file": ("../evil.py", b"x = 1")}}, 422, "filename"),
    ],
)
def test_bad_forms_are_4xx_naming_the_field_and_nothing_is_stored(api, form, status, param):
    before = file_names(api)
    refused(api.post("/v1/files", **form), status, param)
    assert file_names(api) == before


def test_broken_multipart_bodies_are_400_on_body(api):
    before = file_names(api)
    head = b'--XyZ\r\nContent-Disposition: form-data; name="file"; filename="cut.jsonl"\r\n\r\n{"a": 1}\n'
    cut = api.post("/v1/files", content=head, headers={"content-type": "multipart/form-data; boundary=XyZ"})
    assert "closing boundary" in refused(cut, 400, "body")
    no_boundary = api.post("/v1/files", content=head, headers={"content-type": "multipart/form-data"})
    assert "boundary" in refused(no_boundary, 400, "body")
    assert file_names(api) == before


def test_a_raw_upload_still_needs_its_file_name(api):
    refused(api.post("/v1/files", content=b"{}\n", headers={"content-type": "application/octet-stream"}),
            422, "filename")  # fmt: skip
    raw = api.post("/v1/files", params={"filename": "raw.jsonl"}, content=b"{}\n")
    assert raw.status_code == 201 and raw.json()["bytes"] == 3
