"""The session host's inputs as tensors. The API checked their types, ranges and losses; only the
model's own limits (vocabulary, context length) are checked here, as an `InputError` naming the field."""

from __future__ import annotations

from typing import NamedTuple

import torch
from tensordict import TensorDict

from engines.training.adapter_engine import InputError
from engines.training.multi_lora_sample import SampleRequest

WIRE_DTYPES = {"int64": torch.long, "float32": torch.float32}


class Datum(NamedTuple):
    tokens: list[int]
    inputs: dict[str, torch.Tensor]


def tokens_of(tokens: list[int], field: str, vocab: int, max_len: int) -> list[int]:
    if len(tokens) > max_len:
        raise InputError(field, f"{len(tokens)} tokens exceed the model's {max_len}")
    for j, tok in enumerate(tokens):
        if not 0 <= tok < vocab:
            raise InputError(field, f"token {tok!r} at position {j} is outside the vocabulary [0, {vocab})")
    return tokens


def forward_data(data: list[dict], vocab: int, max_len: int) -> list[Datum]:
    """A forward call's data as tensors, its tokens and target tokens inside the model's limits."""
    out: list[Datum] = []
    for i, datum in enumerate(data):
        tokens = tokens_of(datum["tokens"], f"data[{i}].tokens", vocab, max_len)
        inputs = {
            name: torch.tensor(raw["data"], dtype=WIRE_DTYPES[raw["dtype"]]).reshape(raw["shape"])
            for name, raw in datum["loss_fn_inputs"].items()
        }
        targets = inputs.get("target_tokens")
        if targets is not None:
            field = f"data[{i}].loss_fn_inputs.target_tokens"
            tokens_of(targets.flatten().tolist(), field, vocab, targets.numel())
        out.append(Datum(tokens, inputs))
    return out


def rl_rows(data: list[Datum]) -> TensorDict:
    """The data as RL batch rows (engines/training/base.py): a one-token prompt, the rest as the response, and
    `target_tokens` [n, R, K] whose log-probs the engine takes in place of the responses' ([N]: K = 1)."""
    width = max(len(d.tokens) for d in data)
    k = max(d.inputs["target_tokens"].reshape(len(d.tokens), -1).shape[1] for d in data)
    ids = torch.zeros((len(data), width + 1), dtype=torch.long)
    mask = torch.zeros_like(ids)
    targets = torch.zeros((len(data), width, k), dtype=torch.long)
    for i, d in enumerate(data):
        n = len(d.tokens)
        ids[i, :n], mask[i, :n] = torch.tensor(d.tokens), 1
        target = d.inputs["target_tokens"].reshape(n, -1)
        targets[i, :n, : target.shape[1]] = target
    fields = {"input_ids": ids, "attention_mask": mask, "responses": ids[:, 1:],
              "response_mask": mask[:, :-1].clone(), "target_tokens": targets}  # fmt: skip
    return TensorDict(fields, batch_size=[len(data)])


def per_datum(log_probs: torch.Tensor, data: list[Datum]) -> list[torch.Tensor]:
    """The rows' [n, R, K] target log-probs back in each datum's target shape ([N] or [N, K])."""
    out = []
    for i, d in enumerate(data):
        target, n = d.inputs["target_tokens"], len(d.tokens)
        out.append(log_probs[i, :n, : target.reshape(n, -1).shape[1]].reshape(target.shape))
    return out


def wire_tensor(t: torch.Tensor) -> dict:
    t = t.detach().cpu()
    dtype = "int64" if t.dtype == torch.long else "float32"
    return {"data": t.flatten().tolist(), "dtype": dtype, "shape": list(t.shape)}


def sample_request(
    call: dict, adapter: str | None, vocab: int, max_len: int, eos_ids: list[int]
) -> SampleRequest:
    """A sample call as the sampler's request; `stop` None = the EOS ids, strings or token ids otherwise."""
    prompt = tokens_of(call["prompt"], "prompt", vocab, max_len - 1)
    params = call.get("sampling_params") or {}
    room = max_len - len(prompt)
    max_tokens = params.get("max_tokens") or room
    if max_tokens > room:
        raise InputError(
            "sampling_params.max_tokens",
            f"must be an integer in [1, {room}] (prompt {len(prompt)} of {max_len})",
        )
    stop = params.get("stop")
    stop_ids, stop_strings = list(eos_ids), []
    if stop is not None:
        if all(isinstance(s, str) for s in stop):
            stop_ids, stop_strings = [], list(stop)
        else:
            stop_ids = tokens_of(list(stop), "sampling_params.stop", vocab, len(stop))
    return SampleRequest(adapter, prompt, call.get("num_samples", 1), max_tokens,
                         float(params.get("temperature", 1.0)), float(params.get("top_p", 1.0)),
                         params.get("top_k", -1), stop_ids, stop_strings, params.get("seed"))  # fmt: skip
