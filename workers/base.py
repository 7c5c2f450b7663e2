"""Workers declare how their methods are dispatched; the controller executes the declaration.

`@register(...)` only attaches a `MethodSpec`; it imports nothing from the controller. Each `Worker`
owns its mesh registry (its dp rank in each mesh it serves, and whether its output is collected), so
colocated roles in one process each have their own.
"""

from __future__ import annotations

import enum
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])

SPEC_ATTR = "__tandem_dispatch__"


class Dispatch(enum.Enum):
    """How a worker-group call fans out to ranks and how results come back."""

    ONE_TO_ALL = "one_to_all"  # same arguments to every rank; a list of results in rank order
    ALL_TO_ALL = "all_to_all"  # list arguments of length world_size are scattered; list of results
    RANK_ZERO = "rank_zero"  # runs on rank 0 only; its result
    MESH = "mesh"  # a Batch split by the mesh's dp size; collect ranks gathered by dp rank


class Reduce(enum.Enum):
    """What a typed group surface (controller/groups.py) makes of the ranks' results."""

    ALL = "all"  # every rank's result in rank order; a MESH call's Batches come back gathered anyway
    GLOBAL = "global"  # identical on every rank (the engine reduced it over ranks): rank 0's is global
    RANK_ZERO = "rank_zero"  # a per-rank measurement or acknowledgement: rank 0's own


@dataclass(frozen=True)
class MethodSpec:
    """`pad=False`: a MESH method for which a padding row would count (a gradient), so a batch must
    split evenly over the dp ranks."""

    mode: Dispatch
    mesh: str | None = None
    blocking: bool = True
    reduce: Reduce = Reduce.ALL
    pad: bool = True  # MESH: a batch may be padded to the dp size with copies of its first rows

    def __post_init__(self) -> None:
        if self.mode is Dispatch.MESH and not self.mesh:
            raise ValueError("Dispatch.MESH needs a mesh name, e.g. register(Dispatch.MESH, mesh='actor')")
        if self.mode is not Dispatch.MESH and self.mesh is not None:
            raise ValueError(f"mesh={self.mesh!r} only applies to Dispatch.MESH, not {self.mode.name}")


def register(mode: Dispatch, **options: Any) -> Callable[[F], F]:
    """Mark a worker method as callable through a worker group; `options` are MethodSpec's fields."""
    spec = MethodSpec(mode, **options)

    def decorate(fn: F) -> F:
        setattr(fn, SPEC_ATTR, spec)
        return fn

    return decorate


def registered_methods(cls: type) -> dict[str, MethodSpec]:
    """Every method of `cls` (inherited too) that carries a dispatch spec."""
    found: dict[str, MethodSpec] = {}
    for name in dir(cls):
        spec = getattr(getattr(cls, name, None), SPEC_ATTR, None)
        if isinstance(spec, MethodSpec):
            found[name] = spec
    return found


class Worker:
    """Base class of every Ray worker role. Rank and world size come from the worker group's env."""

    def __init__(self) -> None:
        self.rank = int(os.environ.get("RANK", "0"))
        self.world_size = int(os.environ.get("WORLD_SIZE", "1"))
        self._meshes: dict[str, tuple[int, bool]] = {}  # name -> (dp_rank, is_collect)

    def register_mesh(self, name: str, dp_rank: int, is_collect: bool) -> None:
        if name in self._meshes:
            raise ValueError(f"mesh '{name}' is already registered on rank {self.rank}")
        if dp_rank < 0:
            raise ValueError(f"mesh '{name}': dp_rank must be >= 0, got {dp_rank}")
        self._meshes[name] = (int(dp_rank), bool(is_collect))

    @register(Dispatch.ONE_TO_ALL)
    def mesh_info(self, name: str) -> tuple[int, bool]:
        """(dp_rank, is_collect) of this worker in mesh `name`."""
        if name not in self._meshes:
            raise KeyError(
                f"rank {self.rank} has no mesh '{name}' registered (it has: {sorted(self._meshes) or 'none'})"
            )
        return self._meshes[name]
