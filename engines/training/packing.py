"""Remove-padding packing: the real tokens of a micro-batch laid end to end in one row.

Positions restart at 0 for every sequence; attention is kept within a sequence by a block-diagonal
mask or, with flash-attention or engines/kernels/attention.py, the sequence boundaries. Per-token values are
scattered back to the padded [mb, T] grid.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Packed:
    input_ids: torch.Tensor  # [1, N]
    position_ids: torch.Tensor  # [1, N]
    targets: torch.Tensor  # [N]: the next token of the same sequence (0 at each sequence's last token)
    seq_ids: torch.Tensor  # [N]: which row each token came from
    flat_index: torch.Tensor  # [N]: index of each token in the flattened [mb * T] grid
    shape: tuple[int, int]  # (mb, T)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[1])

    def cu_seq_lens(self) -> torch.Tensor:
        """[S + 1] cumulative sequence lengths on the CPU (sequence i is tokens cu[i]:cu[i+1])."""
        lengths = torch.bincount(self.seq_ids, minlength=self.shape[0]).cpu()
        return torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])

    def block_causal_mask(self) -> torch.Tensor:
        """[1, 1, N, N] boolean mask, True = may attend: same sequence and not in the future."""
        same_seq = self.seq_ids[:, None] == self.seq_ids[None, :]
        causal = torch.ones(self.num_tokens, self.num_tokens, dtype=torch.bool, device=same_seq.device).tril()
        return (same_seq & causal)[None, None]


def pack(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> Packed:
    """Pack the real tokens (attention_mask == 1) of each row, rows in order."""
    mb, width = input_ids.shape
    valid = attention_mask.bool()
    flat_index = valid.reshape(-1).nonzero(as_tuple=True)[0]
    ids = input_ids.reshape(-1)[flat_index]
    seq_ids = torch.arange(mb, device=input_ids.device).repeat_interleave(valid.sum(1))
    positions = (valid.long().cumsum(1) - 1).reshape(-1)[flat_index]
    targets = torch.zeros_like(ids)
    same_next = seq_ids[1:] == seq_ids[:-1]
    targets[:-1] = torch.where(same_next, ids[1:], torch.zeros_like(ids[1:]))
    return Packed(ids[None], positions[None], targets, seq_ids, flat_index, (mb, width))


def unpack(values: torch.Tensor, packed: Packed) -> torch.Tensor:
    """Scatter per-token values [N] back to the padded grid [mb, T] (zeros elsewhere); keeps grad."""
    mb, width = packed.shape
    grid = values.new_zeros(mb * width)
    grid = grid.index_put((packed.flat_index,), values)
    return grid.view(mb, width)


def response_columns(grid: torch.Tensor, response_width: int) -> torch.Tensor:
    """The columns of a next-token grid that predict the last `response_width` tokens: [mb, R]."""
    width = grid.shape[1]
    return grid[:, width - response_width - 1 : width - 1]
