"""The session host's input checks: plain python from the API in, tensors out, a bad part an
`InputError` naming its field (the API answers it 4xx in the SDK's error shape). No model is touched here."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch

from engines.adapter_engine import InputError
from engines.multi_lora_sample import SampleRequest
from schema.tinker_losses import LossInputError, check_request

WIRE_DTYPES = {"int64": torch.long, "float32": torch.float32}
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


def check_adam(adam: dict) -> None:
    """The SDK's AdamParams: non-negative numbers, betas below 1."""
    for name in ("learning_rate", "beta1", "beta2", "eps", "weight_decay", "grad_clip_norm"):
        value = adam.get(name, 0.0)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
            raise InputError(f"adam.{name}", f"must be a non-negative number, got {value!r}")
    for name in ("beta1", "beta2"):
        if adam.get(name, 0.9) >= 1:
            raise InputError(f"adam.{name}", "must be below 1")


@dataclass
class Datum:
    tokens: list[int]
    inputs: dict[str, torch.Tensor]


def tokens_of(value: Any, field: str, vocab: int, max_len: int) -> list[int]:
    if not isinstance(value, list) or not value:
        raise InputError(field, "must be a non-empty list of token ids")
    if len(value) > max_len:
        raise InputError(field, f"{len(value)} tokens exceed the model's {max_len}")
    for j, tok in enumerate(value):
        if isinstance(tok, bool) or not isinstance(tok, int) or not 0 <= tok < vocab:
            raise InputError(field, f"token {tok!r} at position {j} is outside the vocabulary [0, {vocab})")
    return value


def tensor_of(raw: Any, field: str) -> torch.Tensor:
    if (
        not isinstance(raw, dict)
        or raw.get("dtype") not in WIRE_DTYPES
        or not isinstance(raw.get("data"), list)
    ):
        raise InputError(field, "must be {data: list, dtype: 'int64'|'float32', shape: list|None}")
    try:
        t = torch.tensor(raw["data"], dtype=WIRE_DTYPES[raw["dtype"]])
        return t.reshape(raw["shape"]) if raw.get("shape") is not None else t
    except (TypeError, ValueError, RuntimeError) as err:
        raise InputError(field, f"cannot be read as a {raw['dtype']} tensor: {err}") from err


def forward_data(op: dict, vocab: int, max_len: int) -> list[Datum]:
    """A forward op's data, checked against the loss (`check_request`) and the vocabulary."""
    data = op.get("data")
    if not isinstance(data, list) or not data:
        raise InputError("data", "must hold at least one datum")
    out: list[Datum] = []
    for i, datum in enumerate(data):
        if not isinstance(datum, dict):
            raise InputError(f"data[{i}]", "must be {tokens, loss_fn_inputs}")
        tokens = tokens_of(datum.get("tokens"), f"data[{i}].tokens", vocab, max_len)
        raw_inputs = datum.get("loss_fn_inputs") or {}
        inputs = {
            name: tensor_of(raw, f"data[{i}].loss_fn_inputs.{name}") for name, raw in raw_inputs.items()
        }
        targets = inputs.get("target_tokens")
        if (
            targets is not None
            and targets.numel()
            and not (0 <= int(targets.min()) and int(targets.max()) < vocab)
        ):
            raise InputError(
                f"data[{i}].loss_fn_inputs.target_tokens",
                f"a token id is outside the vocabulary [0, {vocab})",
            )
        out.append(Datum(tokens, inputs))
    described = [
        (len(d.tokens), {name: (_wire(t), list(t.shape)) for name, t in d.inputs.items()}) for d in out
    ]
    try:
        check_request(op.get("loss_fn"), described, op.get("loss_fn_config"))
    except LossInputError as err:
        raise InputError(err.field, str(err)) from err
    return out


def _wire(t: torch.Tensor) -> str:
    return "int64" if t.dtype == torch.long else "float32"


def wire_tensor(t: torch.Tensor) -> dict:
    t = t.detach().cpu()
    return {
        "data": t.flatten().tolist(),
        "dtype": "int64" if t.dtype == torch.long else "float32",
        "shape": list(t.shape),
    }


def sample_request(
    op: dict, adapter: str | None, vocab: int, max_len: int, eos_ids: list[int]
) -> SampleRequest:
    prompt = tokens_of(op.get("prompt"), "prompt", vocab, max_len - 1)
    n = op.get("num_samples", 1)
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= 128:
        raise InputError("num_samples", "must be an integer in [1, 128]")
    params = op.get("sampling_params") or {}
    room = max_len - len(prompt)
    max_tokens = params.get("max_tokens") or room
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or not 1 <= max_tokens <= room:
        raise InputError(
            "sampling_params.max_tokens",
            f"must be an integer in [1, {room}] (prompt {len(prompt)} of {max_len})",
        )
    temperature = float(params.get("temperature", 1.0))
    if not 0 <= temperature <= 100:
        raise InputError("sampling_params.temperature", "must be in [0, 100]")
    top_p = float(params.get("top_p", 1.0))
    if not 0 < top_p <= 1:
        raise InputError("sampling_params.top_p", "must be in (0, 1]")
    top_k = params.get("top_k", -1)
    if isinstance(top_k, bool) or not isinstance(top_k, int) or (top_k < 1 and top_k != -1):
        raise InputError("sampling_params.top_k", "must be -1 (no limit) or a positive integer")
    seed = params.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise InputError("sampling_params.seed", "must be an integer")
    stop = params.get("stop")
    stop_ids, stop_strings = list(eos_ids), []
    if stop is not None:
        stop = [stop] if isinstance(stop, str) else list(stop)
        if all(isinstance(s, str) for s in stop):
            stop_ids, stop_strings = [], stop
        elif all(isinstance(s, int) and not isinstance(s, bool) and 0 <= s < vocab for s in stop):
            stop_ids = stop
        else:
            raise InputError("sampling_params.stop", "must be strings, or token ids inside the vocabulary")
    return SampleRequest(
        adapter, prompt, n, max_tokens, temperature, top_p, top_k, stop_ids, stop_strings, seed
    )


def name_of(value: Any, field: str) -> str:
    if not isinstance(value, str) or not NAME.match(value):
        raise InputError(
            field, "must be 1-128 letters, digits, '.', '_' or '-', starting with a letter or digit"
        )
    return value
