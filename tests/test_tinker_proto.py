"""The Tinker SDK's wire schema (service/tinker_proto/tinker_sdk.proto) against the SDK itself: the
same fields as the SDK's own generated messages, the checked-in module what `make proto` makes, and
the reader (service/tinker_wire.py) on what the SDK sends and on bodies it never would. No service:
tests/test_tinker_bad_input.py sends hostile bodies over HTTP, tests/test_tinker_wire.py the SDK's."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("tinker")
from google.protobuf.descriptor import Descriptor, FieldDescriptor  # noqa: E402
from tinker import types  # noqa: E402
from tinker.proto import tinker_public_pb2 as sdk  # noqa: E402
from tinker.proto.request_conv import forward_backward_request_to_proto  # noqa: E402

from service.tinker_proto import tinker_sdk_pb2 as ours  # noqa: E402
from service.tinker_wire import MAX_UNKNOWN_BYTES, WireError, read_forward_backward  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
MODULE = "service/tinker_proto/tinker_sdk_pb2.py"


def _shape(field: FieldDescriptor) -> tuple:
    """What decides a field's bytes and meaning: a map is compared as the entries it is encoded as."""
    target = field.message_type or field.enum_type
    oneof = field.containing_oneof
    real_oneof = oneof is not None and not (len(oneof.fields) == 1 and oneof.name == f"_{field.name}")
    return (field.name, field.type, field.is_repeated, field.is_packed, field.has_presence,
            oneof.name if real_oneof else None, target.name if target else None)  # fmt: skip


def _compare(theirs: Descriptor, mine: Descriptor, seen: set[str]) -> None:
    if theirs.full_name in seen:
        return
    seen.add(theirs.full_name)
    assert set(theirs.fields_by_number) == set(mine.fields_by_number), theirs.name
    for number, field in theirs.fields_by_number.items():
        own = mine.fields_by_number[number]
        assert _shape(field) == _shape(own), (theirs.name, number)
        if field.enum_type is not None:
            assert [(v.name, v.number) for v in field.enum_type.values] == [
                (v.name, v.number) for v in own.enum_type.values
            ]
        if field.message_type is not None:
            _compare(field.message_type, own.message_type, seen)


def test_the_schema_has_the_sdks_fields_numbers_types_packing_and_oneofs():
    seen: set[str] = set()
    for name in ("ForwardBackwardRequest", "ForwardBackwardOutput", "SampleResponse"):
        _compare(
            sdk.DESCRIPTOR.message_types_by_name[name], ours.DESCRIPTOR.message_types_by_name[name], seen
        )
    assert len(seen) > 20  # every message reachable from the three, entries included


def test_the_checked_in_module_is_what_make_proto_makes(tmp_path):
    if importlib.util.find_spec("grpc_tools") is None or shutil.which("make") is None:
        pytest.skip("the generator (grpcio-tools, the `dev` extra) or make is not installed here")
    made = subprocess.run(
        ["make", "-s", "-o", "install", "proto", f"BIN={Path(sys.executable).parent}", f"PROTO_OUT={tmp_path}"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert made.returncode == 0, made.stderr
    assert (tmp_path / MODULE).read_text() == (ROOT / MODULE).read_text(), "run `make proto` and commit"


def test_every_field_the_sdk_sends_is_read():
    def datum(tokens: list[int]) -> types.Datum:
        return types.Datum(
            model_input=types.ModelInput.from_ints(tokens),
            loss_fn_inputs={"target_tokens": types.TensorData(data=tokens, dtype="int64", shape=[len(tokens)]),
                            "mask": types.TensorData(data=[1.0, 0.0, 1.0, 1.0], dtype="float32", shape=[2, 2])},
        ).with_provenance(model_input=[types.PromptProvenanceSpan(sequence_id="p", length=len(tokens))],
                          loss_fn_inputs=[types.SampledProvenanceSpan(sequence_id="s", length=len(tokens))])  # fmt: skip

    request = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(
            data=[datum([5, 6, 7, 8]), datum([2**31 - 1, 0, 1, 2])], loss_fn="cispo",
            loss_fn_config={"clip_high_threshold": 1.25, "reduction": "token_mean"}),
        model_id="s:train:3", seq_id=9,
    )  # fmt: skip
    read = read_forward_backward(forward_backward_request_to_proto(request).SerializeToString())
    given = read["forward_backward_input"]
    assert read["model_id"] == "s:train:3" and read["seq_id"] == 9 and given["loss_fn"] == "cispo"
    assert given["loss_fn_config"] == {"clip_high_threshold": 1.25, "reduction": "token_mean"}
    assert [d["model_input"]["chunks"][0]["tokens"] for d in given["data"]] == [
        [5, 6, 7, 8],
        [2**31 - 1, 0, 1, 2],
    ]
    assert given["data"][1]["loss_fn_inputs"] == {
        "target_tokens": {"data": [2**31 - 1, 0, 1, 2], "dtype": "int64", "shape": [4]},
        "mask": {"data": [1.0, 0.0, 1.0, 1.0], "dtype": "float32", "shape": [2, 2]},
    }


def test_unknown_fields_are_passed_over_up_to_a_bound_and_a_misplaced_known_one_is_named():
    request = ours.ForwardBackwardRequest(model_id="m", loss_fn="cross_entropy").SerializeToString()
    later = b"\xfa\x01" + bytes([100]) + b"x" * 100  # field 31, length-delimited: a field of a later SDK
    assert read_forward_backward(request + later)["forward_backward_input"]["loss_fn"] == "cross_entropy"
    with pytest.raises(WireError) as many:
        read_forward_backward(request + b"\x78\x00" * MAX_UNKNOWN_BYTES)  # field 15, varint 0
    assert many.value.field == "body" and str(MAX_UNKNOWN_BYTES) in str(many.value)
    with pytest.raises(WireError) as misplaced:
        read_forward_backward(request + later + b"\x21" + b"\x00" * 8)  # loss_fn (4) as a 64-bit value
    assert misplaced.value.field == "forward_backward_input.loss_fn"
    assert "64-bit" in str(misplaced.value) and "string" in str(misplaced.value)
