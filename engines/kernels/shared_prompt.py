"""Packing a group's prompt once: the n responses of a prompt read one copy of its keys and values.

The packed row holds each distinct prompt once, followed by its rows' responses; positions continue
from the prompt into each response. Gradients flow into the shared prompt from every response, so
the math is the unshared batch's up to summation order. The layout reaches engines/kernels/attention.py as
a keyword transformers passes to every attention call: prompts in a [groups, P] grid, responses in
a [responses, R] grid. `select` names the positions that predict each response token.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class AttentionLayout:
    """The two grids attention runs on: each group's prompt in a row of [G, P] (causal), and each
    response in a row of [S, R] whose keys are its group's prompt followed by its own tokens."""

    slot: torch.Tensor  # [N]: each packed token's cell in the flattened [G * P + S * R] cells
    groups: int  # G
    prompt_len: int  # P, the longest prompt
    response_len: int  # R, the longest response
    response_group: torch.Tensor  # [S]: the group of each response (responses in group order)
    responses_per_group: int  # n when every group has n responses, else 0
    response_mask: torch.Tensor  # [S, 1, R, P + R] bool: True = may attend
    # engines/kernels/shared_attention.py's row indices for this layout, per (tokens, heads, kv heads, dtype)
    plans: dict = field(default_factory=dict, repr=False, compare=False)


@dataclass
class SharedPromptPack:
    input_ids: torch.Tensor  # [1, N]: each distinct prompt once, then its rows' responses
    position_ids: torch.Tensor  # [1, N]
    attention: AttentionLayout  # where engines/kernels/attention.py puts each token, and who reads whom
    select: torch.Tensor  # [M]: the packed position that predicts each response token
    targets: torch.Tensor  # [M]: that response token
    grid_index: torch.Tensor  # [M]: its place in the flattened [mb * R] response grid
    shape: tuple[int, int]  # (mb, R)


def prompt_groups(
    input_ids: torch.Tensor, attention_mask: torch.Tensor, width: int
) -> list[list[int]] | None:
    """Rows with the same prompt (the first T - width columns), in order of first appearance; None
    unless every prompt is left-padded, non-empty, and every response right-padded."""
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
    attention = _attention_layout(segments, len(tokens), device)
    return SharedPromptPack(
        input_ids=torch.tensor([tokens], dtype=input_ids.dtype, device=device),
        position_ids=torch.tensor([positions], dtype=torch.long, device=device),
        attention=attention,
        select=torch.tensor(select, dtype=torch.long, device=device),
        targets=torch.tensor(targets, dtype=input_ids.dtype, device=device),
        grid_index=torch.tensor(grid, dtype=torch.long, device=device),
        shape=(mb, width),
    )


def _attention_layout(
    segments: list[tuple[int, int, int]], num_tokens: int, device: torch.device
) -> AttentionLayout:
    """Where each packed token sits in the prompt grid [G, P] and the response grid [S, R], and
    which of its [prompt ; response] keys each response query may read."""
    group, start, length = torch.tensor(segments, dtype=torch.long).unbind(1)
    is_prompt = torch.ones_like(group, dtype=torch.bool)
    is_prompt[1:] = group[1:] != group[:-1]  # a group's first segment is its prompt
    groups, responses = int(is_prompt.sum()), int((~is_prompt).sum())
    prompt_len = int(length[is_prompt].max())
    response_len = int(length[~is_prompt].max()) if responses else 1
    # Per segment: its row in its own grid; per token: its offset in the segment.
    row = torch.where(is_prompt, is_prompt.cumsum(0) - 1, (~is_prompt).cumsum(0) - 1)
    base = torch.where(is_prompt, row * prompt_len, groups * prompt_len + row * response_len)
    token_segment = torch.repeat_interleave(torch.arange(len(segments)), length)
    slot = base[token_segment] + torch.arange(num_tokens) - start[token_segment]
    response_group = group[~is_prompt]
    # A response query at offset i reads its group's real prompt keys and its own keys 0..i.
    real_prompt = torch.arange(prompt_len)[None, :] < length[is_prompt][:, None]  # [G, P]
    causal = torch.ones(response_len, response_len, dtype=torch.bool).tril()
    mask = torch.cat(
        [real_prompt[response_group][:, None, :].expand(-1, response_len, -1),
         causal[None].expand(responses, -1, -1)],
        dim=2,
    )  # fmt: skip
    return AttentionLayout(
        slot=slot.to(device),
        groups=groups,
        prompt_len=prompt_len,
        response_len=response_len,
        response_group=response_group.to(device),
        responses_per_group=_same_count(response_group, groups),
        response_mask=mask[:, None].to(device),
    )


def _same_count(response_group: torch.Tensor, groups: int) -> int:
    counts = torch.bincount(response_group, minlength=groups)
    return int(counts[0]) if len(counts) and bool((counts == counts[0]).all()) else 0
