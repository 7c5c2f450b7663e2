"""The Tinker SDK's protobuf messages, read and written by hand (torch-free, no generated code).

The SDK (tinker 0.38.0, `tinker/proto/`) always sends `forward_backward` as a protobuf
`ForwardBackwardRequest` (`Content-Type: application/x-protobuf`, zstd-compressed when the server's
client config asks for it), and accepts `ForwardBackwardOutput` and `SampleResponse` results ONLY as
protobuf (`PROTO_SUPPORTED_TYPES`): a JSON body for those two is refused by the client. The field
numbers below are those of the SDK's `tinker_public.proto`; the wire format is protobuf's own
(varints, length-delimited fields, packed repeated scalars, little-endian fixed-width numbers).
The API process must not need the SDK installed, hence this small codec instead of its _pb2 module.
"""

from __future__ import annotations

import struct
from typing import Any

DTYPES = {1: "float32", 2: "int64", 3: "int32", 4: "bfloat16"}
DTYPE_CODES = {"float32": 1, "int64": 2}
_FORMATS = {"float32": "f", "int64": "q", "int32": "i"}


class WireError(ValueError):
    """A body that is not the message it should be; `.field` names where it went wrong."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


# ---- reading ------------------------------------------------------------------------------------


def _varint(buf: bytes, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        if pos >= len(buf):
            raise WireError("body", "truncated protobuf varint")
        byte = buf[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, pos
        shift += 7
        if shift > 70:
            raise WireError("body", "protobuf varint too long")


def fields(buf: bytes) -> list[tuple[int, int, Any]]:
    """(field number, wire type, value) of every field of one message, in order."""
    out: list[tuple[int, int, Any]] = []
    pos = 0
    while pos < len(buf):
        key, pos = _varint(buf, pos)
        number, wire = key >> 3, key & 7
        if number == 0:
            raise WireError("body", "protobuf field number 0 is not valid")
        if wire == 0:
            value, pos = _varint(buf, pos)
        elif wire == 1:
            value, pos = buf[pos : pos + 8], pos + 8
        elif wire == 2:
            size, pos = _varint(buf, pos)
            value, pos = buf[pos : pos + size], pos + size
        elif wire == 5:
            value, pos = buf[pos : pos + 4], pos + 4
        else:
            raise WireError("body", f"unsupported protobuf wire type {wire}")
        if pos > len(buf):
            raise WireError("body", "truncated protobuf message")
        out.append((number, wire, value))
    return out


def _wire(wire: int, want: int, field: str) -> None:
    """A known field sent with another wire type than its declared one is not this message."""
    if wire != want:
        names = {0: "varint", 1: "64-bit", 2: "length-delimited", 5: "32-bit"}
        raise WireError(field, f"protobuf wire type {names.get(wire, wire)} where {names[want]} is declared")


def _text(value: bytes, field: str) -> str:
    try:
        return value.decode()
    except UnicodeDecodeError:
        raise WireError(field, "a string that is not UTF-8") from None


def _double(wire: int, value: Any, field: str) -> float:
    _wire(wire, 1, field)
    return struct.unpack("<d", value)[0]


def _numbers(raw: bytes, dtype: str, field: str) -> list:
    if dtype == "bfloat16":  # upper 16 bits of a float32
        if len(raw) % 2:
            raise WireError(field, f"{len(raw)} bytes are not a whole number of bfloat16 values")
        halves = struct.unpack(f"<{len(raw) // 2}H", raw)
        return list(
            struct.unpack(f"<{len(halves)}f", struct.pack(f"<{len(halves)}I", *(h << 16 for h in halves)))
        )
    fmt = _FORMATS.get(dtype)
    if fmt is None:
        raise WireError(field, f"unsupported tensor dtype {dtype!r}")
    size = struct.calcsize(fmt)
    if len(raw) % size:
        raise WireError(field, f"{len(raw)} bytes are not a whole number of {dtype} values")
    return list(struct.unpack(f"<{len(raw) // size}{fmt}", raw))


def _packed_ints(wire: int, value: Any, field: str) -> list[int]:
    if wire == 0:
        return [value]
    _wire(wire, 2, field)
    out, pos = [], 0
    while pos < len(value):
        number, pos = _varint(value, pos)
        out.append(number - (1 << 64) if number >= 1 << 63 else number)
    return out


def _tensor(buf: bytes, field: str) -> dict[str, Any]:
    dense, dtype_code, shape, sparse = b"", 0, [], False
    for number, wire, value in fields(buf):
        if number == 1:
            _wire(wire, 2, field)
            dense = value
        elif number == 2:
            sparse = True
        elif number == 3:
            _wire(wire, 0, field)
            dtype_code = value
        elif number == 4:
            shape += _packed_ints(wire, value, field)
    if sparse:
        raise WireError(field, "sparse (CSR) tensors are not supported by this service; send them dense")
    dtype = DTYPES.get(dtype_code)
    if dtype is None:
        raise WireError(field, f"unknown tensor dtype code {dtype_code}")
    data = _numbers(dense, dtype, field)
    public = "int64" if dtype in ("int64", "int32") else "float32"
    return {"data": data, "dtype": public, "shape": shape or [len(data)]}


def _map_entry(buf: bytes, field: str) -> tuple[str, list[tuple[int, int, Any]]]:
    key, rest = "", []
    for number, wire, value in fields(buf):
        if number == 1:
            _wire(wire, 2, field)
            key = _text(value, field)
        else:
            rest.append((number, wire, value))
    return key, rest


def _datum(buf: bytes, where: str) -> dict[str, Any]:
    tokens: list[int] = []
    inputs: dict[str, Any] = {}
    for number, wire, value in fields(buf):
        if number == 1:  # a Chunk: only encoded_text is served
            _wire(wire, 2, f"{where}.model_input")
            for kind, kind_wire, chunk in fields(value):
                if kind != 1:
                    name = {2: "image", 3: "dmel"}.get(kind, str(kind))
                    raise WireError(f"{where}.model_input", f"{name} chunks are not supported (text only)")
                _wire(kind_wire, 2, f"{where}.model_input")
                for sub, sub_wire, raw in fields(chunk):
                    if sub == 1:
                        _wire(sub_wire, 2, f"{where}.model_input")
                        tokens += _numbers(raw, "int32", f"{where}.model_input")
        elif number == 2:
            _wire(wire, 2, f"{where}.loss_fn_inputs")
            name, rest = _map_entry(value, f"{where}.loss_fn_inputs")
            where_input = f"{where}.loss_fn_inputs.{name}"
            tensor = b""
            for n, tensor_wire, v in rest:
                if n == 2:
                    _wire(tensor_wire, 2, where_input)
                    tensor = v
            inputs[name] = _tensor(tensor, where_input)
    return {"tokens": tokens, "loss_fn_inputs": inputs}


def read_forward_backward(buf: bytes) -> dict[str, Any]:
    """A `ForwardBackwardRequest` as plain python: model_id, seq_id, data, loss_fn, loss_fn_config,
    forward_only."""
    out: dict[str, Any] = {"model_id": "", "seq_id": 0, "data": [], "loss_fn": "", "forward_only": False}
    config: dict[str, Any] = {}
    where = "forward_backward_input"
    for number, wire, value in fields(buf):
        if number in (1, 3, 4, 5, 7):
            _wire(wire, 2, _TOP_FIELDS[number])
        elif number in (2, 6):
            _wire(wire, 0, _TOP_FIELDS[number])
        if number == 1:
            out["model_id"] = _text(value, "model_id")
        elif number == 2:
            out["seq_id"] = value
        elif number == 3:
            out["data"].append(_datum(value, f"{where}.data[{len(out['data'])}]"))
        elif number == 4:
            out["loss_fn"] = _text(value, f"{where}.loss_fn")
        elif number in (5, 7):
            _config_entry(number, value, config)
        elif number == 6:
            out["forward_only"] = bool(value)
    out["loss_fn_config"] = config or None
    return out


def _config_entry(number: int, value: bytes, config: dict[str, Any]) -> None:
    """One `loss_fn_config` entry: field 5 maps to a double; field 7 (v2) to a double or a string,
    and wins over field 5."""
    where = "forward_backward_input.loss_fn_config"
    key, rest = _map_entry(value, where)
    field = f"{where}.{key}"
    if number == 5:  # a map entry without its value holds the default, 0.0
        doubles = [_double(wire, item, field) for n, wire, item in rest if n == 2]
        config.setdefault(key, doubles[-1] if doubles else 0.0)
        return
    for n, wire, item in rest:
        if n != 2:
            continue
        _wire(wire, 2, field)
        for kind, item_wire, inner in fields(item):
            if kind == 1:
                config[key] = _double(item_wire, inner, field)
            elif kind == 2:
                _wire(item_wire, 2, field)
                config[key] = _text(inner, field)


_TOP_FIELDS = {1: "model_id", 2: "seq_id", 3: "forward_backward_input.data", 4: "forward_backward_input.loss_fn",
               5: "forward_backward_input.loss_fn_config", 6: "forward_only",
               7: "forward_backward_input.loss_fn_config"}  # fmt: skip


# ---- writing ------------------------------------------------------------------------------------


def _put_varint(value: int) -> bytes:
    value &= (1 << 64) - 1
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _len_field(number: int, payload: bytes) -> bytes:
    return _put_varint(number << 3 | 2) + _put_varint(len(payload)) + payload


def _int_field(number: int, value: int) -> bytes:
    return _put_varint(number << 3) + _put_varint(value)


def _double_field(number: int, value: float) -> bytes:
    return _put_varint(number << 3 | 1) + struct.pack("<d", value)


def _packed(values: list[int]) -> bytes:
    return b"".join(_put_varint(v) for v in values)


def write_forward_backward_output(outputs: list[dict[str, dict]], metrics: dict[str, float]) -> bytes:
    """A `ForwardBackwardOutput`: one ArrayRecord per datum (any trailing shape), then the metrics."""
    body = _len_field(1, b"ArrayRecord")
    for datum in outputs:
        record = _len_field(1, b"ArrayRecord") + _int_field(3, 1)
        for name, tensor in datum.items():
            dtype = "int64" if tensor.get("dtype") == "int64" else "float32"
            values = tensor["data"]
            data = struct.pack(f"<{len(values)}{_FORMATS[dtype]}", *values)
            batched = _len_field(1, data) + _len_field(2, struct.pack("<2q", 0, len(data)))
            batched += _int_field(3, DTYPE_CODES[dtype])
            trailing = list(tensor.get("shape") or [len(values)])[1:]
            if trailing:
                batched += _len_field(4, _packed(trailing))
            record += _len_field(2, _len_field(1, name.encode()) + _len_field(2, batched))
        body += _len_field(2, record)
    for key, value in metrics.items():
        body += _len_field(3, _len_field(1, key.encode()) + _double_field(2, float(value)))
    return body


def _floats(values: list) -> bytes:
    return struct.pack(f"<{len(values)}f", *(float("nan") if v is None else v for v in values))


def write_sample_response(sequences: list[dict[str, Any]], prompt_logprobs: list | None) -> bytes:
    """A `SampleResponse`: tokens as int32, log-probs as float32 (NaN where there is none)."""
    body = b""
    for seq in sequences:
        msg = _int_field(1, 1 if seq.get("stop_reason") == "length" else 0)
        msg += _len_field(2, struct.pack(f"<{len(seq['tokens'])}i", *seq["tokens"]))
        if seq.get("logprobs") is not None:
            msg += _len_field(3, _floats(seq["logprobs"]))
        body += _len_field(1, msg)
    if prompt_logprobs is not None:
        body += _len_field(2, _floats(prompt_logprobs))
    return body
