"""Packing a group's prompt once: the n responses of a prompt read one copy of its keys and values.

GRPO samples n responses per prompt, and a batch holds the prompt n times. Packed without sharing,
every copy runs through every layer, forward and backward. Here the packed row holds each distinct
prompt once, followed by its rows' responses; position ids continue from the prompt into each
response, and attention lets a response token see the prompt's tokens and the tokens before it in
its own response. Gradients flow into the shared prompt from every response that reads it, so the
math is that of the unshared batch: only the order of the floating-point sums changes.

The layout is built once per micro-batch and handed to the attention function (engines/attention.py)
as a keyword that transformers passes down to every attention call. The outputs: the hidden state
that predicts response token t of a row is the prompt's last token for t = 0 and the row's own
token t - 1 after it; `select` names those positions of the packed row, `grid_index` where each
lands in the [mb, R] response grid.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class SharedPromptPack:
    input_ids: torch.Tensor  # [1, N]: each distinct prompt once, then its rows' responses
    position_ids: torch.Tensor  # [1, N]
    query_index: torch.Tensor  # [S, Lq]: packed index of each segment's own tokens (0 past its end)
    key_index: torch.Tensor  # [S, Lk]: packed index of the segment's prompt (if any), then its own tokens
    key_mask: torch.Tensor  # [S, 1, Lq, Lk] bool: True = may attend
    token_slot: torch.Tensor  # [N]: each packed token's slot in the flattened [S * Lq] query grid
    select: torch.Tensor  # [M]: the packed position that predicts each response token
    targets: torch.Tensor  # [M]: that response token
    grid_index: torch.Tensor  # [M]: its place in the flattened [mb * R] response grid
    shape: tuple[int, int]  # (mb, R)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[1])


def prompt_groups(
    input_ids: torch.Tensor, attention_mask: torch.Tensor, width: int
) -> list[list[int]] | None:
    """Rows with the same prompt (the first T - width columns), in order of first appearance.

    None when the layout does not allow sharing: a prompt that is not one run of tokens ending at
    column T - width (left padding), a row without prompt, or a response that is not one run of
    tokens starting there (right padding).
    """
    prompt_width = input_ids.shape[1] - width
    mask = attention_mask.bool()
    prompt_lens, response_lens = mask[:, :prompt_width].sum(1), mask[:, prompt_width:].sum(1)
    columns = torch.arange(input_ids.shape[1], device=mask.device)
    expected = (columns >= prompt_width - prompt_lens[:, None]) & (
        columns < prompt_width + response_lens[:, None]
    )
    if prompt_width == 0 or not torch.equal(expected, mask) or bool((prompt_lens == 0).any()):
        return None
    prompts = (input_ids[:, :prompt_width] * mask[:, :prompt_width]).tolist()
    groups: dict[tuple[int, ...], list[int]] = {}
    for row, (prompt, length) in enumerate(zip(prompts, prompt_lens.tolist(), strict=True)):
        groups.setdefault((length, *prompt), []).append(row)
    return list(groups.values())


def pack_shared(
    input_ids: torch.Tensor, attention_mask: torch.Tensor, width: int, groups: list[list[int]]
) -> SharedPromptPack:
    """Pack a micro-batch with one copy of each group's prompt (`groups` from `prompt_groups`)."""
    mb, total = input_ids.shape
    prompt_width = total - width
    prompt_lens = attention_mask[:, :prompt_width].sum(1).tolist()
    response_lens = attention_mask[:, prompt_width:].sum(1).tolist()
    ids = input_ids.tolist()
    tokens: list[int] = []
    positions: list[int] = []
    segments: list[tuple[int, int, int, int]] = []  # (start, length, prefix start, prefix length)
    select: list[int] = []
    grid: list[int] = []
    targets: list[int] = []
    for rows in groups:
        prompt_len = prompt_lens[rows[0]]
        prompt_start = len(tokens)
        tokens += ids[rows[0]][prompt_width - prompt_len : prompt_width]
        positions += range(prompt_len)
        segments.append((prompt_start, prompt_len, 0, 0))
        for row in rows:
            response_len = response_lens[row]
            if response_len == 0:
                continue
            start = len(tokens)
            response = ids[row][prompt_width : prompt_width + response_len]
            tokens += response
            positions += range(prompt_len, prompt_len + response_len)
            segments.append((start, response_len, prompt_start, prompt_len))
            select += [prompt_start + prompt_len - 1, *range(start, start + response_len - 1)]
            grid += range(row * width, row * width + response_len)
            targets += response
    device = input_ids.device
    query_index, key_index, key_mask, token_slot = _attention_layout(segments, len(tokens), device)
    return SharedPromptPack(
        input_ids=torch.tensor([tokens], dtype=input_ids.dtype, device=device),
        position_ids=torch.tensor([positions], dtype=torch.long, device=device),
        query_index=query_index,
        key_index=key_index,
        key_mask=key_mask,
        token_slot=token_slot,
        select=torch.tensor(select, dtype=torch.long, device=device),
        targets=torch.tensor(targets, dtype=input_ids.dtype, device=device),
        grid_index=torch.tensor(grid, dtype=torch.long, device=device),
        shape=(mb, width),
    )


def _attention_layout(
    segments: list[tuple[int, int, int, int]], num_tokens: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Index tensors and the mask of the padded [segments, ...] grid the attention runs on."""
    start, length, prefix_start, prefix_len = torch.tensor(segments, dtype=torch.long).unbind(1)
    longest = int(length.max())
    keys = int((prefix_len + length).max())
    q = torch.arange(longest)[None, :]
    query_index = torch.where(q < length[:, None], start[:, None] + q, 0)
    k = torch.arange(keys)[None, :]
    in_prefix = k < prefix_len[:, None]
    own = k - prefix_len[:, None]
    key_index = torch.where(
        in_prefix, prefix_start[:, None] + k, torch.where(own < length[:, None], start[:, None] + own, 0)
    )
    # Query j of a segment sits after its prefix_len prompt tokens: it sees keys up to prefix_len + j.
    # Padded query rows (j >= length) still see a real key, so no row of the softmax is empty.
    key_mask = (k[:, None, :] <= prefix_len[:, None, None] + q[:, :, None]) & (
        k[:, None, :] < (prefix_len + length)[:, None, None]
    )
    token_slot = torch.empty(num_tokens, dtype=torch.long)
    slots = torch.arange(len(segments))[:, None] * longest + q
    token_slot[query_index[q < length[:, None]]] = slots[q < length[:, None]]
    return (
        query_index.to(device),
        key_index.to(device),
        key_mask[:, None].to(device),
        token_slot.to(device),
    )
