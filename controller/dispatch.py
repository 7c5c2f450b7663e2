"""How one worker-group call fans out to ranks and how results come back: pure planning and collection
over the ranks' mesh registrations (`MeshLayout`); the Ray calls live in worker_group.py.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # imported where used: the Tinker API binds a worker group without importing torch
    from workers.batch import Batch


@dataclass(frozen=True)
class MeshLayout:
    """Each global rank's (dp rank, is_collect) in one named mesh."""

    name: str
    dp_rank: tuple[int, ...]  # indexed by global rank
    is_collect: tuple[bool, ...]

    @classmethod
    def from_info(cls, name: str, info: Sequence[tuple[int, bool]]) -> MeshLayout:
        """Validated: dp ranks 0..D-1, exactly one collect rank each."""
        layout = cls(name, tuple(int(d) for d, _ in info), tuple(bool(c) for _, c in info))
        dp_size = layout.dp_size
        if sorted(set(layout.dp_rank)) != list(range(dp_size)):
            raise ValueError(
                f"mesh '{name}': dp ranks must be 0..{dp_size - 1} with none missing, got {list(layout.dp_rank)}"
            )
        for dp in range(dp_size):
            collectors = [r for r in range(len(info)) if layout.dp_rank[r] == dp and layout.is_collect[r]]
            if len(collectors) != 1:
                raise ValueError(
                    f"mesh '{name}': dp rank {dp} must have exactly one collect rank, has ranks {collectors}"
                )
        return layout

    @property
    def world_size(self) -> int:
        return len(self.dp_rank)

    @property
    def dp_size(self) -> int:
        return len(set(self.dp_rank))

    def collect_ranks(self) -> list[int]:
        collectors = [r for r in range(self.world_size) if self.is_collect[r]]
        return sorted(collectors, key=lambda r: self.dp_rank[r])


def split_for_mesh(layout: MeshLayout, batch: Batch, pad: bool = True) -> tuple[list[Batch], int]:
    """Pad `batch` to a multiple of the dp size and split it: one chunk per dp rank, and the pad.
    pad=False (a method whose every row counts, e.g. in a gradient) refuses a batch that needs it."""
    from workers.batch import Batch

    if not isinstance(batch, Batch):
        raise TypeError(
            f"a MESH call on mesh '{layout.name}' takes a Batch first, got {type(batch).__name__}"
        )
    if not pad and len(batch) % layout.dp_size:
        raise ValueError(
            f"a batch of {len(batch)} rows does not split evenly over the {layout.dp_size} data-parallel "
            f"ranks of mesh '{layout.name}', and padding rows would count twice: send a multiple of "
            f"{layout.dp_size} rows (several calls can accumulate, engines/training/base.py)"
        )
    padded, pad = batch.pad_to_multiple(layout.dp_size)
    return padded.chunk(layout.dp_size), pad


def collect_from_mesh(layout: MeshLayout, outputs_by_rank: Sequence[Any], pad: int) -> Any:
    """Gather the collect ranks' outputs by dp rank; Batches are concatenated and unpadded."""
    from workers.batch import Batch

    gathered = [outputs_by_rank[r] for r in layout.collect_ranks()]
    if all(isinstance(out, Batch) for out in gathered):
        return Batch.concat(gathered).unpad(pad)
    return gathered


def scatter_all_to_all(world_size: int, args: tuple, kwargs: dict) -> list[tuple[tuple, dict]]:
    """Per-rank (args, kwargs): every list/tuple argument must have one entry per rank."""

    def pick(value: Any, rank: int, what: str) -> Any:
        if not isinstance(value, list | tuple) or len(value) != world_size:
            raise ValueError(
                f"ALL_TO_ALL argument {what} must be a list of {world_size} values, one per rank"
            )
        return value[rank]

    return [
        (
            tuple(pick(a, r, f"#{i}") for i, a in enumerate(args)),
            {k: pick(v, r, f"'{k}'") for k, v in kwargs.items()},
        )
        for r in range(world_size)
    ]
