"""Packing a group's prompt once: the n responses of a prompt read one copy of its keys and values.

GRPO samples n responses per prompt, and a batch holds the prompt n times. Packed without sharing,
every copy runs through every layer, forward and backward. Here the packed row holds each distinct
prompt once, followed by its rows' responses; position ids continue from the prompt into each
response, and attention lets a response token see the prompt's tokens and the tokens before it in
its own response. Gradients flow into the shared prompt from every response that reads it, so the
math is that of the unshared batch: only the order of the floating-point sums changes.

The layout is built once per micro-batch and handed to the attention function (engines/attention.py)
as a keyword that transformers passes down to every attention call. Attention runs per group: a
group's prompt and responses are contiguous in the packed row, so they fill one row of a padded
[groups, longest group] grid, and one mask per group says who sees whom (the prompt causal, each
response its prompt and its own earlier tokens). Per-segment attention, where every response
gathered its own copy of the prompt's keys and values, measured 1.6-2x slower forward + backward on
SmolLM2's shapes (bench/RESULTS.md, issue 34): the copies and their index_add backward cost more
than the masked-out work of the group blocks. The outputs: the hidden state
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
    group_slot: torch.Tensor  # [N]: each packed token's slot in the flattened [G * Lg] group grid
    group_mask: torch.Tensor  # [G, 1, Lg, Lg] bool: True = may attend
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
    segments: list[tuple[int, int, int]] = []  # (group, start, length); a group's prompt is segment 0
    select: list[int] = []
    grid: list[int] = []
    targets: list[int] = []
    for group, rows in enumerate(groups):
        prompt_len = prompt_lens[rows[0]]
        prompt_start = len(tokens)
        tokens += ids[rows[0]][prompt_width - prompt_len : prompt_width]
        positions += range(prompt_len)
        segments.append((group, prompt_start, prompt_len))
        for row in rows:
            response_len = response_lens[row]
            if response_len == 0:
                continue
            start = len(tokens)
            response = ids[row][prompt_width : prompt_width + response_len]
            tokens += response
            positions += range(prompt_len, prompt_len + response_len)
            segments.append((group, start, response_len))
            select += [prompt_start + prompt_len - 1, *range(start, start + response_len - 1)]
            grid += range(row * width, row * width + response_len)
            targets += response
    device = input_ids.device
    group_slot, group_mask = _attention_layout(segments, len(tokens), device)
    return SharedPromptPack(
        input_ids=torch.tensor([tokens], dtype=input_ids.dtype, device=device),
        position_ids=torch.tensor([positions], dtype=torch.long, device=device),
        group_slot=group_slot,
        group_mask=group_mask,
        select=torch.tensor(select, dtype=torch.long, device=device),
        targets=torch.tensor(targets, dtype=input_ids.dtype, device=device),
        grid_index=torch.tensor(grid, dtype=torch.long, device=device),
        shape=(mb, width),
    )


def _attention_layout(
    segments: list[tuple[int, int, int]], num_tokens: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """(slot of each packed token in the flattened [G * Lg] grid, the [G, 1, Lg, Lg] mask)."""
    group, start, length = torch.tensor(segments, dtype=torch.long).unbind(1)
    groups = int(group[-1]) + 1
    first = torch.ones_like(group, dtype=torch.bool)
    first[1:] = group[1:] != group[:-1]  # a group's first segment is its prompt
    group_start = start[first]
    group_len = torch.zeros(groups, dtype=torch.long).index_add_(0, group, length)
    longest = int(group_len.max())
    # Per token: its group, its offset in the group's row, and the segment it belongs to.
    token_segment = torch.repeat_interleave(torch.arange(len(segments)), length)
    token_group = group[token_segment]
    offset = torch.arange(num_tokens) - group_start[token_group]
    group_slot = token_group * longest + offset
    # Per grid cell: the segment of its token (-1 for padding), and whether that segment is a prompt.
    cell_segment = torch.full((groups * longest,), -1, dtype=torch.long)
    cell_segment[group_slot] = token_segment
    cell_segment = cell_segment.view(groups, longest)
    is_prompt = torch.where(cell_segment >= 0, first[cell_segment.clamp(min=0)], False)
    pos = torch.arange(longest)
    causal = pos[None, :] <= pos[:, None]  # [Lg query, Lg key]
    same = cell_segment[:, :, None] == cell_segment[:, None, :]
    real_key = cell_segment[:, None, :] >= 0
    # A token sees the earlier tokens of its own segment; a response token also sees its whole prompt.
    reads_prompt = is_prompt[:, None, :] & ~is_prompt[:, :, None] & (cell_segment >= 0)[:, :, None]
    mask = real_key & ((same & causal) | reads_prompt)
    # Padded query cells still see key 0 (the prompt's first token), so no row of the softmax is empty.
    mask[:, :, 0] |= cell_segment < 0
    return group_slot.to(device), mask[:, None].to(device)
