"""The fixed-width training layout of generated rows: the prompt left-padded to max_prompt_length,
the response right-padded to max_new_tokens, so the chunks of all dp ranks concatenate."""

from __future__ import annotations

from itertools import chain

import torch
from tensordict import TensorDict


def rollout_tensors(
    prompts: list[list[int]], completions: list, width: int, new_tokens: int, pad: int
) -> TensorDict:
    tokens = [c.token_ids[:new_tokens] for c in completions]
    log_probs = [c.log_probs[: len(t)] for c, t in zip(completions, tokens, strict=True)]
    tensors = layout(prompts, tokens, log_probs, width, new_tokens, pad)
    tensors["response_mask"] = tensors["attention_mask"][:, width:].clone()
    tensors["weight_version"] = torch.tensor([c.weight_version for c in completions], dtype=torch.long)
    # 1 where generation stopped at the token budget (finish reason "length"), for over-long handling.
    tensors["truncated"] = torch.tensor([c.finish_reason == "length" for c in completions], dtype=torch.long)
    return TensorDict(tensors, batch_size=[len(prompts)])


def layout(
    prompts: list[list[int]],
    responses: list[list[int]],
    log_probs: list[list[float]],
    width: int,
    new_tokens: int,
    pad: int,
) -> dict[str, torch.Tensor]:
    """input_ids, attention_mask, responses and rollout_log_probs of the rows (each response fits)."""
    rows = len(prompts)
    prompt_lengths = torch.tensor([len(p) for p in prompts], dtype=torch.long)
    if rows and int(prompt_lengths.max()) > width:
        raise ValueError(
            f"prompt of {int(prompt_lengths.max())} tokens is longer than max_prompt_length={width}"
        )
    token_lengths = torch.tensor([len(t) for t in responses], dtype=torch.long)
    input_ids = torch.full((rows, width + new_tokens), pad, dtype=torch.long)
    place_rows(input_ids, prompts, width - prompt_lengths)
    place_rows(input_ids, responses, torch.full((rows,), width))
    columns = torch.arange(width + new_tokens)
    attention_mask = (
        (columns >= (width - prompt_lengths)[:, None]) & (columns < (width + token_lengths)[:, None])
    ).long()
    rollout_log_probs = torch.zeros(rows, new_tokens)
    place_rows(rollout_log_probs, log_probs)
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "responses": input_ids[:, width:].clone(),
        "rollout_log_probs": rollout_log_probs,
    }


def place_rows(out: torch.Tensor, rows: list[list], starts: torch.Tensor | None = None) -> None:
    """Write row i of `rows` into out[i, starts[i]:] (starts: 0) in one indexed copy for the batch."""
    lengths = torch.tensor([len(r) for r in rows], dtype=torch.long)
    total = int(lengths.sum())
    if total == 0:
        return
    row = torch.repeat_interleave(torch.arange(len(rows)), lengths)
    column = torch.arange(total) - torch.repeat_interleave(lengths.cumsum(0) - lengths, lengths)
    if starts is not None:
        column += starts[row]
    out[row, column] = torch.tensor(list(chain.from_iterable(rows)), dtype=out.dtype)
