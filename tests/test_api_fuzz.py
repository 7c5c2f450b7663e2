"""A bounded schemathesis run over the service's own OpenAPI document, with real auth: no request may
get a 5xx, and every response must be documented (status, content type, schema).

The service runs without its scheduler, so the jobs the fuzzer manages to submit stay queued and
no training starts. About a minute on an idle 2-core machine (MAX_EXAMPLES per operation).
"""

from __future__ import annotations

import pytest

schemathesis = pytest.importorskip("schemathesis")  # pinned in the dev extra

from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402
from schemathesis.checks import not_a_server_error  # noqa: E402
from schemathesis.specs.openapi.checks import (  # noqa: E402
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from tests.api_util import start_service  # noqa: E402

MAX_EXAMPLES = 6
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]


@pytest.fixture(scope="module")
def fuzzed(ray_cluster, tmp_path_factory):
    monkey = pytest.MonkeyPatch()
    monkey.setenv("TANDEM_HOME", str(tmp_path_factory.getbasetemp() / "home"))
    svc = start_service(tmp_path_factory.mktemp("fuzz"), schedule=False)
    yield svc
    svc.stop()
    monkey.undo()


def test_no_server_errors_and_documented_responses(fuzzed):
    schema = schemathesis.openapi.from_url(fuzzed.url + "/openapi.json")
    headers = {"Authorization": f"Bearer {fuzzed.token}"}
    # /readyz is 503 by design here: this service's scheduler is not started
    operations = [op for op in (r.ok() for r in schema.get_all_operations()) if op.path != "/readyz"]
    assert len(operations) > 15

    for operation in operations:

        @given(case=operation.as_strategy())
        @settings(max_examples=MAX_EXAMPLES, deadline=None, derandomize=True, database=None,
                  phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))  # fmt: skip
        def run(case) -> None:
            response = case.call(headers=headers, timeout=30)
            case.validate_response(response, checks=CHECKS)

        run()
