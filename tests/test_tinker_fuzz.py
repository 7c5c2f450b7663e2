"""A bounded property-based fuzz of the Tinker routes (beside tests/test_api_fuzz.py's schemathesis
run over the OpenAPI routes, which leaves /api/v1 out): JSON bodies built from each route's request
model with any JSON where its fields go, random protobuf bytes, and valid SDK messages with bytes
flipped, cut or inserted. No answer may be a 5xx (the SDK would retry it for minutes), and every
4xx is in the SDK's error shape. The service runs without Ray: no body reaches a session host.
"""

from __future__ import annotations

import httpx
import pytest

pytest.importorskip("tinker")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from tinker import types  # noqa: E402
from tinker.proto.request_conv import forward_backward_request_to_proto  # noqa: E402

from api.settings import ServeSettings  # noqa: E402
from service import tinker_requests as req  # noqa: E402
from tests.api_util import start_service  # noqa: E402
from tests.tinker_loops import owner_keys  # noqa: E402

BASE = "/nonexistent/tinker-base"
MAX_EXAMPLES = 25
FUZZ = settings(max_examples=MAX_EXAMPLES, deadline=None, derandomize=True, database=None,
                suppress_health_check=list(HealthCheck))  # fmt: skip

ROUTES = {
    "create_session": req.CreateSession, "session_heartbeat": req.SessionRef, "retrieve_future": req.FutureRef,
    "cancel_future": req.FutureRef, "create_model": req.CreateModel, "get_info": req.ModelRef,
    "forward_backward": req.ForwardBackward, "forward": req.ForwardBackward, "optim_step": req.OptimStep,
    "save_weights": req.SaveWeights, "load_weights": req.LoadWeights, "save_weights_for_sampler": req.SaveWeights,
    "unload_model": req.ModelRef, "create_sampling_session": req.CreateSamplingSession, "asample": req.Sample,
    "save_weights_external": req.SaveWeights,
}  # fmt: skip
NUMBERS = st.one_of(st.integers(min_value=-(2**70), max_value=2**70), st.floats(allow_nan=False, allow_infinity=False),
                    st.sampled_from([0, -1, 1, 2**63, 2**64, 1e308, -0.0]))  # fmt: skip
SCALARS = st.one_of(st.none(), st.booleans(), NUMBERS, st.text(max_size=20))
JSON = st.recursive(SCALARS, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                     st.dictionaries(st.text(max_size=8), inner, max_size=4)),
                    max_leaves=12)  # fmt: skip


def _nested(model: type) -> dict:
    """Any JSON where each field of `model` goes, and a valid-shaped object where a field is a model."""
    fields = {}
    for name, info in model.model_fields.items():
        key = info.validation_alias.choices[0] if info.validation_alias is not None else name
        inner = [a for a in getattr(info.annotation, "__args__", (info.annotation,)) if isinstance(a, type)
                 and issubclass(a, req.Body)]  # fmt: skip
        fields[key] = (
            st.one_of(JSON, st.fixed_dictionaries({}, optional=_nested(inner[0]))) if inner else JSON
        )
    return fields


def bodies(model: type) -> st.SearchStrategy:
    return st.one_of(JSON, st.fixed_dictionaries({}, optional=_nested(model)))


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    live = start_service(tmp_path_factory.mktemp("tinker-fuzz"), schedule=False,
                         settings=ServeSettings(tinker_base_models=[BASE]))  # fmt: skip
    with httpx.Client(base_url=live.url, headers={"X-API-Key": owner_keys(live)["alice"]}, timeout=30) as c:
        yield c
    live.stop()


def _answered(response: httpx.Response) -> None:
    assert response.status_code < 500, (response.request.url, response.request.content[:300], response.text)
    if response.status_code >= 400 and response.request.url.path.startswith("/api/v1/"):
        body = response.json()
        assert isinstance(body["error"], str) and body["category"] == "user", body


@pytest.mark.parametrize("route", sorted(ROUTES))
def test_json_bodies_never_get_a_server_error(client, route):
    @FUZZ
    @given(body=bodies(ROUTES[route]))
    def run(body) -> None:
        _answered(client.post(f"/api/v1/{route}", json=body))

    run()


def _valid_message() -> bytes:
    datum = types.Datum(model_input=types.ModelInput.from_ints([1, 2, 300]),
                        loss_fn_inputs={"target_tokens": [2, 300, 4], "weights": [0.0, 1.0, 0.5]})  # fmt: skip
    request = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(data=[datum], loss_fn="ppo",
                                                          loss_fn_config={"clip_low_threshold": 0.8}),
        model_id="s:train:0", seq_id=7,
    )  # fmt: skip
    return forward_backward_request_to_proto(request).SerializeToString()


@st.composite
def mutated(draw, message: bytes) -> bytes:
    out = bytearray(message)
    for _ in range(draw(st.integers(1, 4))):
        where = draw(st.integers(0, len(out)))
        kind = draw(st.sampled_from(["flip", "cut", "insert"]))
        if kind == "flip" and where < len(out):
            out[where] = draw(st.integers(0, 255))
        elif kind == "cut":
            del out[where : where + draw(st.integers(1, 8))]
        else:
            out[where:where] = draw(st.binary(min_size=1, max_size=8))
    return bytes(out)


def test_protobuf_bodies_never_get_a_server_error(client):
    valid = _valid_message()
    proto = {"content-type": "application/x-protobuf"}

    @settings(FUZZ, max_examples=4 * MAX_EXAMPLES)
    @given(body=st.one_of(st.binary(max_size=256), mutated(valid)))
    def run(body) -> None:
        _answered(client.post("/api/v1/forward_backward", content=body, headers=proto))

    run()
