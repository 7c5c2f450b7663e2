"""The API's contract against a live service: one error shape everywhere, the OpenAPI document that
says so (with the bearer scheme), Swagger UI without a CDN, and request bodies that cannot be stored
(lone surrogates, integers beyond 64 bits) refused with the field named and nothing written."""

from __future__ import annotations

import httpx
import pytest

from tests.api_util import tiny_job

BIG = 2**63


def _error(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


def test_unknown_routes_wrong_methods_and_bad_json_use_the_error_shape(live, api):
    assert _error(api.get("/v1/nope"), 404)["code"] == "unknown_route"
    assert _error(httpx.get(live.url + "/nope"), 404)["type"] == "not_found_error"
    assert _error(api.put("/v1/jobs"), 405)["code"] == "method_not_allowed"
    truncated = api.post("/v1/jobs", content=b'{"method": "grpo", "trainer": {"total_st',
                         headers={"content-type": "application/json"})  # fmt: skip
    error = _error(truncated, 422)
    assert error["param"] == "body" and error["message"].startswith("body:")


def test_a_json_body_sent_as_a_form_names_the_content_type_header(api):
    """curl's `-d` alone sends `application/x-www-form-urlencoded`: the answer says which header to add."""
    for path in ("/v1/rewards/validate", "/v1/jobs"):
        sent = api.post(path, content=b'{"function": "builtin:exact_match", "rows": []}',
                        headers={"content-type": "application/x-www-form-urlencoded"})  # fmt: skip
        error = _error(sent, 415)
        assert "Content-Type: application/json" in error["message"], error
        assert "application/x-www-form-urlencoded" in error["message"]
        assert error["param"] == "body" and error["code"] == "unsupported_media_type"


def test_a_trailing_slash_is_a_404_in_the_error_shape_never_a_redirect(api):
    """A REST client should not have to follow a 307: FastAPI's redirect_slashes is off."""
    for path in ("/v1/jobs/abc/", "/v1/jobs/", "/v1/jobs/job-0123456789ab/metrics/", "/v1/files/"):
        response = api.get(path, follow_redirects=False)
        assert _error(response, 404)["code"] == "unknown_route", path
        assert "location" not in response.headers
    assert api.get("/v1/jobs").status_code == 200


def test_a_path_with_a_nul_byte_is_a_422_naming_the_field_not_a_500(api):
    for field, body in (("data.train_path", {"data": {"train_path": "a\u0000b.jsonl"}}),
                        ("trainer.mlflow_uri", {"trainer": {"loggers": ["mlflow"], "mlflow_uri": "runs\u0000"}})):  # fmt: skip
        assert _error(api.post("/v1/jobs/validate", json=tiny_job(**body)), 422)["param"] == field


def test_bogus_status_filter_is_422(api):
    error = _error(api.get("/v1/jobs", params={"status": "bogus"}), 422)
    assert error["param"] == "status"
    assert api.get("/v1/jobs", params={"status": ["queued", "failed"]}).status_code == 200


def test_a_lone_surrogate_is_refused_and_nothing_is_stored(api):
    before = len(api.get("/v1/jobs", params={"limit": 100}).json()["data"])
    body = '{"method": "grpo", "model": {"builtin": "tiny-qwen2"}, "metadata": {"k": "\\ud800"}}'
    error = _error(api.post("/v1/jobs", content=body, headers={"content-type": "application/json"}), 422)
    assert error["param"] == "metadata.k"
    listed = api.get("/v1/jobs", params={"limit": 100})
    assert listed.status_code == 200 and len(listed.json()["data"]) == before
    key = '{"function": "builtin:exact_match", "rows": [{"response": "a", "extra": {"\\udc00": 1}}]}'
    error = _error(
        api.post("/v1/rewards/validate", content=key, headers={"content-type": "application/json"}), 422
    )
    assert error["param"] == "rows.0.extra"


@pytest.mark.parametrize(
    "method,path,kwargs,param",
    [
        ("post", "/v1/jobs", {"json": tiny_job(trainer={"total_steps": BIG})}, "trainer.total_steps"),
        ("post", "/v1/jobs", {"json": tiny_job(trainer={"seed": -BIG - 1})}, "trainer.seed"),
        ("post", "/v1/jobs/job_x/fork", {"json": {"overrides": {"trainer": {"total_steps": BIG}}}},
         "overrides.trainer.total_steps"),
        ("post", "/v1/jobs/job_x/fork", {"json": {"checkpoint_step": BIG}}, "checkpoint_step"),
        ("get", "/v1/jobs/job_x/events", {"params": {"after": BIG}}, "after"),
        ("get", "/v1/jobs/job_x/metrics", {"params": {"step_max": BIG}}, "step_max"),
        ("get", "/v1/jobs/job_x/logs/stream", {"params": {"after": BIG}}, "after"),
    ],
)  # fmt: skip
def test_integers_beyond_64_bits_are_422_naming_the_field(api, method, path, kwargs, param):
    error = _error(getattr(api, method)(path, **kwargs), 422)
    assert error["param"] == param and param in error["message"]
    assert api.get("/healthz").status_code == 200  # the connection and the service are still fine


def test_a_bad_reward_is_422_on_every_route(api):
    validate = api.post("/v1/rewards/validate", json={"function": "nope_mod:f", "rows": [{"response": "x"}]})
    submit = api.post("/v1/jobs", json=tiny_job(reward={"function": "nope_mod:f"}))
    assert _error(validate, 422)["code"] == _error(submit, 422)["code"] == "invalid_reward_function"


def test_openapi_declares_the_bearer_scheme_and_the_real_error_schema(live):
    doc = httpx.get(live.url + "/openapi.json").json()
    assert doc["components"]["securitySchemes"]["HTTPBearer"] == {
        "type": "http", "scheme": "bearer", "description": doc["components"]["securitySchemes"]["HTTPBearer"]
        ["description"]}  # fmt: skip
    assert "HTTPValidationError" not in doc["components"]["schemas"]
    error_ref = {"$ref": "#/components/schemas/ErrorResponse"}
    for path, operations in doc["paths"].items():
        if not path.startswith("/v1/"):
            continue
        for method, operation in operations.items():
            assert operation["security"] == [{"HTTPBearer": []}], (method, path)
            for status in ("401", "403", "422"):
                schema = operation["responses"][status]["content"]["application/json"]["schema"]
                assert schema == error_ref, (method, path, status)
    submit = doc["paths"]["/v1/jobs"]["post"]["responses"]
    assert {"400", "409", "413"} <= set(submit)
    detail = doc["components"]["schemas"]["ErrorDetail"]["properties"]
    assert set(detail) == {"message", "type", "param", "code"}


def test_swagger_ui_is_served_without_a_cdn(live):
    page = httpx.get(live.url + "/docs")
    assert page.status_code == 200 and "/static/vendor/swagger-ui-bundle.js" in page.text
    assert "cdn" not in page.text.lower() and "https://" not in page.text
    bundle = httpx.get(live.url + "/static/vendor/swagger-ui-bundle.js")
    assert bundle.status_code == 200 and "SwaggerUIBundle" in bundle.text
    assert httpx.get(live.url + "/static/vendor/swagger-ui.css").status_code == 200


@pytest.mark.parametrize(
    "patch,param",
    [
        ({"resources": {"cpus_per_worker": 5e-324}}, "resources.cpus_per_worker"),
        ({"resources": {"gpus_per_worker": 0.001}}, "resources.gpus_per_worker"),
        ({"trainer": {"seed": 2**40}}, "trainer.seed"),
        ({"trainer": {"prompts_per_step": 10**9}}, "trainer.prompts_per_step"),
        ({"rollout": {"max_new_tokens": 10**9}}, "rollout.max_new_tokens"),
        ({"algorithm": {"max_tokens_per_micro_batch": True}}, "algorithm.max_tokens_per_micro_batch"),
        ({"rollout": {"n": True}}, "rollout.n"),
        ({"resources": {"workers": 64}, "trainer": {"prompts_per_step": 64}}, "resources"),
        ({"algorithm": {"rollout_correction": {"is_cap": 1e7}}}, "algorithm.rollout_correction.is_cap"),
        (
            {"algorithm": {"rollout_correction": {"rejection_high": 1e7}}},
            "algorithm.rollout_correction.rejection_high",
        ),
    ],
)
def test_values_that_would_fail_later_are_422_at_submission(api, patch, param):
    error = _error(api.post("/v1/jobs", json=tiny_job(**patch)), 422)
    assert error["param"] == param, error


@pytest.mark.parametrize(
    "section,param",
    [('"optim": {"lr": 1e999}', "optim.lr"),
     ('"algorithm": {"rollout_correction": {"is_cap": 1e999}}', "algorithm.rollout_correction.is_cap"),
     ('"algorithm": {"rollout_correction": {"rejection_high": 1e999}}',
      "algorithm.rollout_correction.rejection_high")],
)  # fmt: skip
def test_non_finite_numbers_are_422(api, section, param):
    body = '{"model": {"builtin": "tiny-qwen2"}, ' + section + "}"
    error = _error(api.post("/v1/jobs", content=body, headers={"content-type": "application/json"}), 422)
    assert error["param"] == param and "finite" in error["message"]
