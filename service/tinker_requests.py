"""The Tinker API's request bodies as the SDK sends them (`tinker/types/*_request.py`), typed strictly:
a wrong type is a 400 naming the dotted field; fields the SDK may add later are ignored. Floats are
finite (a NaN learning rate would poison the adapter), seeds 63-bit (torch's generator, SQLite). A zstd
body is read as a stream that stops at its cap (a 413), never expanded whole."""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal, TypeVar

from pydantic import AliasChoices, BaseModel, ConfigDict, Field, ValidationError, model_validator

from service.errors import ServiceError
from service.tinker_wire import WireError, read_forward_backward

SEED_LIMIT = 2**63
FLOAT32_MAX = 3.4028234663852886e38
MAX_TAGS = 32
MAX_SAMPLES = 128
MAX_NEW_TOKENS = 4096
MAX_RATIO = 64  # a real body compresses a few times; FLOOR_BYTES is always allowed, for tiny bodies
FLOOR_BYTES = 1024 * 1024
READ_BYTES = 256 * 1024
Id = Annotated[str, Field(min_length=1, max_length=512)]
Whole = Annotated[int, Field(ge=0, lt=SEED_LIMIT)]  # a token id, seed, sequence number or span position
# the SDK reads a run's user_metadata as text values: anything else would break every listing
UserMetadata = Annotated[dict[Annotated[str, Field(max_length=256)], Annotated[str, Field(max_length=4096)]],
                         Field(max_length=64)]  # fmt: skip
MAX_TTL_S = 10 * 365 * 86400
TtlSeconds = Annotated[int, Field(ge=1, le=MAX_TTL_S)]


class TinkerError(ServiceError):
    """A refused request: HTTP status, message and the field at fault, answered under /api/v1 in the
    SDK's shape (api/errors.py)."""

    def __init__(self, status: int, message: str, field: str | None = None) -> None:
        super().__init__(message, status, field)


def not_found(what: str, ident: str, field: str) -> TinkerError:
    return TinkerError(404, f"{field}: no {what} '{ident}' (or it is another owner's)", field)


class Body(BaseModel):
    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="ignore", protected_namespaces=())


class CreateSession(Body):
    tags: list[Annotated[str, Field(max_length=256)]] = Field(default_factory=list)
    user_metadata: dict[str, Any] | None = None


class SessionRef(Body):
    session_id: Id


class FutureRef(Body):
    request_id: Id


class ModelRef(Body):
    model_id: Id


class LoraConfig(Body):
    rank: int = Field(32, ge=1, le=1 << 20)
    seed: Whole | None = None
    train_attn: bool = True  # the order of the stored target modules
    train_mlp: bool = True
    train_unembed: bool = True


class OptimizerConfig(Body):
    type: Literal["adamw"] = "adamw"


class CreateModel(Body):
    session_id: Id
    model_seq_id: Whole
    base_model: Id
    lora_config: LoraConfig | None = None
    optimizer_config: OptimizerConfig | None = None
    user_metadata: UserMetadata | None = None


class AdamParams(Body):
    type: Literal["adam", "adamw"] | None = None
    learning_rate: float = Field(1e-4, ge=0)
    beta1: float = Field(0.9, ge=0, lt=1)
    beta2: float = Field(0.95, ge=0, lt=1)
    eps: float = Field(1e-12, ge=0)
    weight_decay: float = Field(0.0, ge=0)
    grad_clip_norm: float = Field(0.0, ge=0)


class OptimStep(Body):
    model_id: Id
    adam_params: AdamParams = Field(
        default_factory=AdamParams, validation_alias=AliasChoices("adam_params", "optim_params", "optimizer_params")
    )  # fmt: skip


class SaveWeights(Body):
    """save_weights, save_weights_for_sampler and save_weights_external: each reads its own fields."""

    model_id: Id
    path: str | None = Field(None, max_length=512)
    overwrite: bool = False
    kind: str = Field("snapshot", max_length=64)
    ttl_seconds: TtlSeconds | None = None
    age_encryption_recipients: list[Annotated[str, Field(max_length=1024)]] | None = Field(
        None, max_length=64
    )


class CheckpointTtl(Body):
    ttl_seconds: TtlSeconds | None


class LoadWeights(CreateModel):
    """load_state of a live model, or (without model_id) a new one from the state: a create_model."""

    path: Id
    optimizer: bool = False
    model_id: Id | None = None
    session_id: Id | None = None
    model_seq_id: Whole = 0
    base_model: Id | None = None


class CreateSamplingSession(Body):
    session_id: Id
    sampling_session_seq_id: Whole = 0
    base_model: Id | None = None
    model_path: Id | None = None


class Chunk(Body):
    """Text, or an image or audio chunk: typed so that the refusal says which kind is not served."""

    type: Literal["encoded_text", "image", "image_asset_pointer", "dmel"] = "encoded_text"
    tokens: list[Whole] = Field(default_factory=list)


class ModelInput(Body):
    chunks: list[Chunk] = Field(default_factory=list)

    def tokens(self, where: str) -> list[int]:
        out: list[int] = []
        for j, chunk in enumerate(self.chunks):
            if chunk.type != "encoded_text":
                raise TinkerError(400, f"{where}.chunks[{j}]: {chunk.type} chunks are not supported (text only)",
                                  f"{where}.chunks[{j}]")  # fmt: skip
            out += chunk.tokens
        return out


class Tensor(Body):
    data: list[float] = Field(default_factory=list)  # finite; an int64 tensor's are whole (then ints)
    dtype: Literal["float32", "int64"] = "float32"
    shape: list[Annotated[int, Field(ge=0, le=1 << 40)]] | None = Field(None, max_length=8)

    @model_validator(mode="after")
    def _consistent(self) -> Tensor:
        if self.dtype == "int64":
            if not all(v.is_integer() for v in self.data):
                raise ValueError("an int64 tensor holds whole numbers only")
            self.data = [int(v) for v in self.data]
        elif any(abs(v) > FLOAT32_MAX for v in self.data):  # the host's tensor would hold inf
            raise ValueError(f"a float32 tensor holds values within +-{FLOAT32_MAX:g}")
        size = math.prod(self.shape or [len(self.data)])
        if size != len(self.data):
            raise ValueError(f"shape {self.shape} holds {size} values; data has {len(self.data)}")
        self.shape = self.shape or [len(self.data)]  # what the host reshapes to
        return self


class Span(Body):
    """A provenance span: datum positions that repeat tokens of a recorded sample's prompt or output."""

    kind: Literal["prompt", "sampled"]
    sequence_id: Id
    offset: Whole = 0
    length: Whole


class Datum(Body):
    model_input: ModelInput
    loss_fn_inputs: dict[Annotated[str, Field(max_length=128)], Tensor] = Field(default_factory=dict)
    model_input_spans: list[Span] | None = None
    loss_fn_input_spans: list[Span] | None = None


ConfigValue = Annotated[float, Field(allow_inf_nan=False)] | Annotated[str, Field(max_length=256)]


class ForwardInput(Body):
    data: list[Datum] = Field(default_factory=list)
    loss_fn: str = Field("", max_length=128)
    loss_fn_config: dict[Annotated[str, Field(max_length=128)], ConfigValue] | None = None


class ForwardBackward(Body):
    """Sent as JSON (curl) or protobuf (the SDK; read into this shape: a refusal names the same field)."""

    model_id: Id
    forward_backward_input: ForwardInput = Field(default_factory=ForwardInput)
    forward_only: bool = False

    def plain(self) -> dict[str, Any]:
        """Tokens per datum and plain tensors: what the host's forward_backward takes."""
        given = self.forward_backward_input
        data = [{"tokens": d.model_input.tokens(f"forward_backward_input.data[{i}].model_input"),
                 "loss_fn_inputs": {name: t.model_dump() for name, t in d.loss_fn_inputs.items()},
                 "spans": {"model_input_spans": [s.model_dump() for s in d.model_input_spans or []],
                           "loss_fn_input_spans": [s.model_dump() for s in d.loss_fn_input_spans or []]}}
                for i, d in enumerate(given.data)]  # fmt: skip
        return {"model_id": self.model_id, "data": data, "loss_fn": given.loss_fn,
                "loss_fn_config": given.loss_fn_config, "forward_only": self.forward_only}  # fmt: skip


class Forward(ForwardBackward):
    """`forward`: forward_backward's body, whatever its forward_only; a missing model is a 404."""

    model_id: str = Field("", max_length=512)

    @model_validator(mode="after")
    def _only(self) -> Forward:
        self.forward_only = True
        return self


class SamplingParams(Body):
    max_tokens: int | None = Field(None, ge=1, le=MAX_NEW_TOKENS)
    seed: Whole | None = None
    stop: Annotated[str, Field(max_length=1024)] | list[Annotated[str, Field(max_length=1024)]] | list[Whole] | None = (
        Field(None, max_length=64)
    )  # fmt: skip
    temperature: float = Field(1.0, ge=0, le=100)
    top_k: int = Field(-1, ge=-1, lt=SEED_LIMIT)
    top_p: float = Field(1.0, gt=0, le=1)


class Sample(Body):
    sampling_session_id: Id | None = None
    prompt: ModelInput
    num_samples: int = Field(1, ge=1, le=MAX_SAMPLES)
    sampling_params: SamplingParams = Field(default_factory=SamplingParams)
    prompt_logprobs: bool | None = None
    topk_prompt_logprobs: int = 0
    topk_sample_logprobs: int = 0
    target_prompt_logprobs: dict[str, Any] | None = None
    prompt_alt_tokens_k: int = 0
    prompt_logprobs_last_n: int | None = None
    record_stability_info: bool | None = None


Model = TypeVar("Model", bound=BaseModel)


def refusal(err: ValidationError) -> TinkerError:
    """The first validation error as a 400 naming its dotted field (`sampling_params.max_tokens`)."""
    first = err.errors(include_url=False)[0]
    if first["type"] == "json_invalid":
        why = (first.get("ctx") or {}).get("error", "invalid JSON")
        return TinkerError(400, f"body: the request body is not valid JSON ({why})", "body")
    field = dotted(first["loc"])
    return TinkerError(400, f"{field}: {first['msg']}", field)


def dotted(loc: tuple[Any, ...]) -> str:
    """`("data", 0, "model_input")` as `data[0].model_input`, less the union members pydantic names."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif not (part in _PRIMITIVES or part.startswith(("constrained-", "list[", "function-"))):
            out += f".{part}" if out else part
    return out or "body"


_PRIMITIVES = {"str", "int", "float", "bool"}


def parse_body(model: type[Model], raw: bytes | dict[str, Any]) -> Model:
    """A JSON body (empty is `{}`) or the protobuf reader's python as `model`; else a 400 naming the field."""
    try:
        return model.model_validate(raw) if isinstance(raw, dict) else model.model_validate_json(raw or b"{}")
    except ValidationError as err:
        raise refusal(err) from None


def decompressed(raw: bytes, cap: int) -> bytes:
    """A zstd body, read as a stream; a 413 as soon as its output passes what `raw` may expand to."""
    import zstandard

    limit = min(cap, max(FLOOR_BYTES, MAX_RATIO * len(raw)))
    out = bytearray()
    try:
        with zstandard.ZstdDecompressor().stream_reader(raw, read_across_frames=True) as reader:
            while chunk := reader.read(READ_BYTES):
                out += chunk
                if len(out) > limit:
                    raise TinkerError(413, f"body: the zstd body expands past {limit} bytes ({len(raw)} "
                                      f"compressed; at most {MAX_RATIO}x, up to {cap}), more than a "
                                      "forward_backward request of the models served needs", "body")  # fmt: skip
    except zstandard.ZstdError as err:
        raise TinkerError(400, f"body: not a zstd frame ({err})", "body") from None
    return bytes(out)


def forward_request(
    model: type[ForwardBackward], raw: bytes, encoding: str, content_type: str, cap: int
) -> dict[str, Any]:
    """A forward/forward_backward body (zstd or not, protobuf or JSON) typed (finite floats, whole token
    ids, consistent tensor shapes), in the shape the host's forward takes."""
    if encoding == "zstd":
        raw = decompressed(raw, cap)
    elif encoding not in ("", "identity"):
        raise TinkerError(
            400, f"Content-Encoding: {encoding!r} is not served (zstd or none)", "Content-Encoding"
        )
    if "protobuf" in content_type:
        try:
            raw = read_forward_backward(raw)
        except WireError as err:
            raise TinkerError(400, str(err), err.field) from None
    return parse_body(model, raw).plain()
