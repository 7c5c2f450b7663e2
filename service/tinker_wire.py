"""The SDK's protobuf bodies (`forward_backward` in; its output and `SampleResponse` out), read and
written with service/tinker_proto/'s messages. A request is read into a JSON body's shape, so a refusal
names the same field; what the parser passes over is refused here: a known field with another wire
type, text that is not UTF-8, tensor bytes that are not a whole number of values."""

from __future__ import annotations

import struct
from typing import Any

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
_CONFIG = f"{_FBI}.loss_fn_config"
# where a refusal points for each field of a message (dotted onto the message's own place)
_REQUEST = {1: "model_id", 2: "seq_id", 3: f"{_FBI}.data", 4: f"{_FBI}.loss_fn", 5: _CONFIG,
            6: "forward_only", 7: _CONFIG}  # fmt: skip
_DATUM = {1: ".model_input", 2: ".loss_fn_inputs", 3: ".model_input_spans", 4: ".loss_fn_input_spans"}
_ENTRY = {1: "", 2: ".{key}"}


class WireError(ValueError):
    """A body that is not the message it should be; `.field` names where it went wrong."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


def read_forward_backward(buf: bytes) -> dict[str, Any]:
    """A `ForwardBackwardRequest` as plain python: model_id, seq_id, data (tokens and loss_fn_inputs
    per datum), loss_fn, loss_fn_config, forward_only."""
    request = _parsed(buf)
    size = request.ByteSize()
    request.DiscardUnknownFields()
    unknown = size - request.ByteSize()
    if unknown > MAX_UNKNOWN_BYTES:
        raise WireError("body", f"{unknown} bytes of protobuf fields this service does not know "
                                f"(at most {MAX_UNKNOWN_BYTES} are passed over)")  # fmt: skip
    # only a body with unknown fields can hold a misplaced known one: read it again, keeping them
    return _Reader(strict=unknown > 0).request(_parsed(buf) if unknown else request)


def _parsed(buf: bytes) -> pb.ForwardBackwardRequest:
    request = pb.ForwardBackwardRequest()
    try:
        request.ParseFromString(buf)
    except DecodeError as err:
        raise WireError("body", f"malformed protobuf ({err})") from None
    return request


class _Reader:
    def __init__(self, strict: bool) -> None:
        self.strict = strict

    def request(self, msg: pb.ForwardBackwardRequest) -> dict[str, Any]:
        self.declared(msg, "", _REQUEST)
        return {"model_id": _text(msg.model_id, "model_id"), "seq_id": msg.seq_id,
                "data": [self.datum(d, f"{_FBI}.data[{i}]") for i, d in enumerate(msg.data)],
                "loss_fn": _text(msg.loss_fn, f"{_FBI}.loss_fn"), "loss_fn_config": self.config(msg) or None,
                "forward_only": msg.forward_only}  # fmt: skip

    def datum(self, msg: pb.Datum, where: str) -> dict[str, Any]:
        self.declared(msg, where, _DATUM)
        tokens: list[int] = []
        for chunk in msg.model_input:
            self.declared(chunk, f"{where}.model_input")
            kind = chunk.WhichOneof("chunk")
            if kind not in (None, "encoded_text"):
                raise WireError(f"{where}.model_input", f"{kind} chunks are not supported (text only)")
            self.declared(chunk.encoded_text, f"{where}.model_input")
            tokens += _values(chunk.encoded_text.tokens, pb.DTYPE_INT32, f"{where}.model_input")
        inputs, base = {}, f"{where}.loss_fn_inputs"
        for entry in msg.loss_fn_inputs:
            name = _text(entry.key, base)
            self.declared(entry, base, _ENTRY, name)
            inputs[name] = self.tensor(entry.value, f"{base}.{name}")
        spans = {name: [self.span(s, f"{where}.{name}[{j}]") for j, s in enumerate(getattr(msg, name))]
                 for name in ("model_input_spans", "loss_fn_input_spans")}  # fmt: skip
        return {"tokens": tokens, "loss_fn_inputs": inputs, **spans}

    def span(self, msg: pb.ProvenanceSpan, where: str) -> dict[str, Any]:
        self.declared(msg, where)
        kind = msg.WhichOneof("span")
        if kind is None:
            raise WireError(where, "a provenance span with neither prompt_tokens nor sampled_tokens")
        arm = getattr(msg, kind)
        self.declared(arm, where)
        return {"kind": "prompt" if kind == "prompt_tokens" else "sampled", "offset": arm.offset,
                "sequence_id": _text(arm.sequence_id, f"{where}.sequence_id"), "length": arm.length}  # fmt: skip

    def tensor(self, tensor: pb.Tensor, where: str) -> dict[str, Any]:
        self.declared(tensor, where)
        if tensor.WhichOneof("encoding") == "sparse_csr":
            raise WireError(where, "sparse (CSR) tensors are not supported by this service; send them dense")
        data = _values(tensor.dense, tensor.dtype, where)
        dtype = "int64" if tensor.dtype in (pb.DTYPE_INT64, pb.DTYPE_INT32) else "float32"
        return {"data": data, "dtype": dtype, "shape": list(tensor.shape) or [len(data)]}

    def config(self, msg: pb.ForwardBackwardRequest) -> dict[str, Any]:
        """Field 5 maps to doubles; field 7 to a double or a text, and wins (the SDK writes both)."""
        config: dict[str, Any] = {}
        for entry in [*msg.loss_fn_config, *msg.loss_fn_config_v2]:
            key = _text(entry.key, _CONFIG)
            self.declared(entry, _CONFIG, _ENTRY, key)
            if isinstance(entry.value, float):
                config[key] = entry.value
                continue
            self.declared(entry.value, f"{_CONFIG}.{key}")
            kind = entry.value.WhichOneof("value")
            if kind == "number":
                config[key] = entry.value.number
            elif kind == "text":
                config[key] = _text(entry.value.text, f"{_CONFIG}.{key}")
        return config

    def declared(self, msg: Message, where: str, places: dict[int, str] | None = None, key: str = "") -> None:
        """A known field sent with another wire type than its declared one is not this message."""
        if not self.strict:
            return
        fields = msg.DESCRIPTOR.fields_by_number
        for unknown in UnknownFieldSet(msg):
            field = fields.get(unknown.field_number)
            if field is not None:
                where += places[field.number].format(key=key) if places else ""
                wire = _WIRE_TYPES.get(unknown.wire_type, str(unknown.wire_type))
                kind = FieldDescriptorProto.Type.Name(field.type).removeprefix("TYPE_").lower()
                raise WireError(where, f"protobuf wire type {wire} for {field.name}, declared as {kind}")


def _text(value: str | bytes, field: str) -> str:
    """The parser leaves text unchecked (tinker_sdk.proto) and gives bytes where it is not UTF-8."""
    if isinstance(value, bytes):
        raise WireError(field, "a string that is not UTF-8")
    return value


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
