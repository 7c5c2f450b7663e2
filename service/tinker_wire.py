"""The SDK's protobuf bodies (`forward_backward` in; its output and `SampleResponse` out), read and
written with service/tinker_proto/'s messages. A request is read into a JSON body's shape and checked
by one walk over its messages' descriptors, so that a refusal names the JSON body's field: a known
field with another wire type and text that are not UTF-8 (both passed over by the parser), tensor
bytes that are not a whole number of values."""

from __future__ import annotations

import functools
import struct
from typing import Any

from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.descriptor_pb2 import FieldDescriptorProto
from google.protobuf.message import DecodeError, Message
from google.protobuf.unknown_fields import UnknownFieldSet

from service.tinker_proto import tinker_sdk_pb2 as pb

# Fields this service does not know are passed over, up to this many bytes in all: finding the
# misplaced known ones among them costs per field, and the SDK's own requests have none.
MAX_UNKNOWN_BYTES = 64 * 1024
_FORMATS = {pb.DTYPE_FLOAT32: "f", pb.DTYPE_INT64: "q", pb.DTYPE_INT32: "i"}
_WIRE_TYPES = {0: "varint", 1: "64-bit", 2: "length-delimited", 3: "group", 5: "32-bit"}
_FBI = "forward_backward_input"
# Where the JSON body has a request field: its protobuf keeps flat what its JSON nests.
_TOP = {"data": f"{_FBI}.data", "loss_fn": f"{_FBI}.loss_fn", "loss_fn_config": f"{_FBI}.loss_fn_config",
        "loss_fn_config_v2": f"{_FBI}.loss_fn_config"}  # fmt: skip
_NAMED = {"Datum", "PromptProvenanceSpan", "SampledProvenanceSpan"}  # whose fields add their names
_ITEMS = {"data", "model_input_spans", "loss_fn_input_spans"}  # whose items add their index


class WireError(ValueError):
    """A body that is not the message it should be; `.field` names where it went wrong."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


def read_forward_backward(buf: bytes) -> dict[str, Any]:
    """A `ForwardBackwardRequest` in the JSON body's shape (its text chunks as one)."""
    request = _parsed(buf)
    size = request.ByteSize()
    request.DiscardUnknownFields()
    unknown = size - request.ByteSize()
    if unknown > MAX_UNKNOWN_BYTES:
        raise WireError("body", f"{unknown} bytes of protobuf fields this service does not know "
                                f"(at most {MAX_UNKNOWN_BYTES} are passed over)")  # fmt: skip
    # only a body with unknown fields can hold a misplaced known one: read it again, keeping them
    request = _parsed(buf) if unknown else request
    _check(request, "", strict=unknown > 0)
    data = [_datum(d, f"{_FBI}.data[{i}]") for i, d in enumerate(request.data)]
    given = {"data": data, "loss_fn": request.loss_fn, "loss_fn_config": _config(request) or None}
    return {"model_id": request.model_id, "seq_id": request.seq_id, "forward_backward_input": given,
            "forward_only": request.forward_only}  # fmt: skip


def _parsed(buf: bytes) -> pb.ForwardBackwardRequest:
    request = pb.ForwardBackwardRequest()
    try:
        request.ParseFromString(buf)
    except DecodeError as err:
        raise WireError("body", f"malformed protobuf ({err})") from None
    return request


def _place(where: str, field: FieldDescriptor, msg: Message) -> str:
    """Where the JSON body has `field` of `msg` (at `where`): a chunk, tensor or value is one place."""
    kind = msg.DESCRIPTOR.name
    if kind == "ForwardBackwardRequest":
        return _TOP.get(field.name, field.name)
    if kind.endswith("Entry"):  # a map's entry: its value is named by its key
        return f"{where}.{msg.key}" if field.name == "value" else where  # type: ignore[attr-defined]
    return f"{where}.{field.name}" if kind in _NAMED else where


def _check(msg: Message, where: str, strict: bool) -> None:
    """What the parser passes over, in `msg` and what it holds: text that is not UTF-8 (unchecked by
    it, tinker_sdk.proto), and (`strict`) a known field sent with another wire type than declared."""
    for field, value in msg.ListFields():
        place = _place(where, field, msg)
        if field.type == field.TYPE_STRING and isinstance(value, bytes):
            raise WireError(place, "a string that is not UTF-8")
        if field.message_type is not None and (strict or _holds_text(field.message_type)):
            for i, item in enumerate(value if field.is_repeated else [value]):
                _check(item, f"{place}[{i}]" if field.name in _ITEMS else place, strict)
    known = msg.DESCRIPTOR.fields_by_number
    for unknown in UnknownFieldSet(msg) if strict else ():
        field = known.get(unknown.field_number)
        if field is not None:
            wire = _WIRE_TYPES.get(unknown.wire_type, str(unknown.wire_type))
            kind = FieldDescriptorProto.Type.Name(field.type).removeprefix("TYPE_").lower()
            message = f"protobuf wire type {wire} for {field.name}, declared as {kind}"
            raise WireError(_place(where, field, msg), message)


@functools.cache
def _holds_text(kind: Descriptor) -> bool:
    return any(
        f.type == f.TYPE_STRING or (f.message_type and _holds_text(f.message_type)) for f in kind.fields
    )


def _datum(msg: pb.Datum, where: str) -> dict[str, Any]:
    tokens: list[int] = []
    for chunk in msg.model_input:
        kind = chunk.WhichOneof("chunk")
        if kind not in (None, "encoded_text"):
            raise WireError(f"{where}.model_input", f"{kind} chunks are not supported (text only)")
        tokens += _values(chunk.encoded_text.tokens, pb.DTYPE_INT32, f"{where}.model_input")
    base = f"{where}.loss_fn_inputs"
    inputs = {e.key: _tensor(e.value, f"{base}.{e.key}") for e in msg.loss_fn_inputs}
    spans = {name: [_span(s, f"{where}.{name}[{j}]") for j, s in enumerate(getattr(msg, name))]
             for name in ("model_input_spans", "loss_fn_input_spans")}  # fmt: skip
    return {"model_input": {"chunks": [{"tokens": tokens}]}, "loss_fn_inputs": inputs, **spans}


def _span(msg: pb.ProvenanceSpan, where: str) -> dict[str, Any]:
    kind = msg.WhichOneof("span")
    if kind is None:
        raise WireError(where, "a provenance span with neither prompt_tokens nor sampled_tokens")
    arm = getattr(msg, kind)
    return {"kind": kind.removesuffix("_tokens"), "offset": arm.offset, "sequence_id": arm.sequence_id,
            "length": arm.length}  # fmt: skip


def _tensor(tensor: pb.Tensor, where: str) -> dict[str, Any]:
    if tensor.WhichOneof("encoding") == "sparse_csr":
        raise WireError(where, "sparse (CSR) tensors are not supported by this service; send them dense")
    data = _values(tensor.dense, tensor.dtype, where)
    dtype = "int64" if tensor.dtype in (pb.DTYPE_INT64, pb.DTYPE_INT32) else "float32"
    return {"data": data, "dtype": dtype, "shape": list(tensor.shape) or [len(data)]}


def _config(msg: pb.ForwardBackwardRequest) -> dict[str, Any]:
    """Field 5 maps to doubles; field 7 to a double or a text, and wins (the SDK writes both)."""
    config: dict[str, Any] = {e.key: e.value for e in msg.loss_fn_config}
    for entry in msg.loss_fn_config_v2:
        kind = entry.value.WhichOneof("value")
        if kind is not None:
            config[entry.key] = getattr(entry.value, kind)
    return config


def _values(raw: bytes, dtype: int, field: str) -> list:
    if dtype == pb.DTYPE_BFLOAT16:  # the upper half of a float32
        if len(raw) % 2:
            raise WireError(field, f"{len(raw)} bytes are not a whole number of bfloat16 values")
        wide = bytearray(2 * len(raw))
        wide[2::4], wide[3::4] = raw[0::2], raw[1::2]
        raw, dtype = bytes(wide), pb.DTYPE_FLOAT32
    fmt = _FORMATS.get(dtype)
    if fmt is None:
        raise WireError(field, f"unknown tensor dtype code {dtype}")
    size = struct.calcsize(fmt)
    if len(raw) % size:
        name = pb.DType.Name(dtype).removeprefix("DTYPE_").lower()
        raise WireError(field, f"{len(raw)} bytes are not a whole number of {name} values")
    return list(struct.unpack(f"<{len(raw) // size}{fmt}", raw))


def write_forward_backward_output(outputs: list[dict[str, dict]], metrics: dict[str, float]) -> bytes:
    """A `ForwardBackwardOutput`: one ArrayRecord per datum (any trailing shape), then the metrics."""
    out = pb.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord")
    for datum in outputs:
        record = out.loss_fn_outputs.add(type_tag="ArrayRecord", num_datums=1)
        for name, tensor in datum.items():
            dtype = pb.DTYPE_INT64 if tensor.get("dtype") == "int64" else pb.DTYPE_FLOAT32
            values = tensor["data"]
            data = struct.pack(f"<{len(values)}{_FORMATS[dtype]}", *values)
            field = record.fields[name]
            field.data, field.offsets, field.dtype = data, struct.pack("<2q", 0, len(data)), dtype
            field.trailing_shape.extend(list(tensor.get("shape") or [len(values)])[1:])
    for key, value in metrics.items():
        out.metrics[key] = float(value)
    return out.SerializeToString()


def _floats(values: list) -> bytes:
    return struct.pack(f"<{len(values)}f", *(float("nan") if v is None else v for v in values))


def write_sample_response(sequences: list[dict[str, Any]], prompt_logprobs: list | None) -> bytes:
    """A `SampleResponse`: tokens as int32, log-probs as float32 (NaN where there is none)."""
    out = pb.SampleResponse()
    for seq in sequences:
        stop = pb.STOP_REASON_LENGTH if seq.get("stop_reason") == "length" else pb.STOP_REASON_STOP
        sampled = out.sequences.add(
            stop_reason=stop, tokens=struct.pack(f"<{len(seq['tokens'])}i", *seq["tokens"])
        )
        if seq.get("logprobs") is not None:
            sampled.logprobs = _floats(seq["logprobs"])
    if prompt_logprobs is not None:
        out.prompt_logprobs = _floats(prompt_logprobs)
    return out.SerializeToString()
