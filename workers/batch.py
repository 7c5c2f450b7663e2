"""The Batch protocol: the currency between the controller and the workers.

Three aligned things: `tensors` (a TensorDict, dim 0 the sample axis), `non_tensors` (numpy object
arrays of the same length) and `meta` (per-batch settings, typed ones through the helpers at the
end). Every operation that produces several batches deep-copies `meta` into each.
"""

from __future__ import annotations

import copy
import operator
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from tensordict import TensorDict

from engines.rollout.base import SamplingParams
from schema.workers import EnvironmentConfig

Index = int | slice | Sequence[int] | np.ndarray | torch.Tensor


def _as_object_array(values: Any) -> np.ndarray:
    """A 1-D numpy object array holding `values` one per row (lists stay lists, not new axes)."""
    if isinstance(values, np.ndarray) and values.dtype == object and values.ndim == 1:
        return values
    values = list(values)
    out = np.empty(len(values), dtype=object)
    out[:] = values
    return out


def _index_array(index: Index, length: int) -> np.ndarray | slice:
    if isinstance(index, slice):
        return index
    if isinstance(index, torch.Tensor):
        index = index.cpu().numpy()
    array = np.asarray(index)
    if array.dtype == bool:
        if array.shape != (length,):
            raise IndexError(f"boolean index has shape {array.shape}, expected ({length},)")
        return np.nonzero(array)[0]
    if array.ndim != 1 or not np.issubdtype(array.dtype, np.integer):
        raise IndexError(f"index must be a slice or a 1-D integer/boolean array, got {array!r}")
    return array


@dataclass
class Batch:
    tensors: TensorDict
    non_tensors: dict[str, np.ndarray] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.tensors, TensorDict):
            raise TypeError(f"Batch.tensors must be a TensorDict, got {type(self.tensors).__name__}")
        if len(self.tensors.batch_size) != 1:
            raise ValueError(
                f"Batch.tensors needs exactly one batch dimension, got {self.tensors.batch_size}"
            )
        self.non_tensors = {k: _as_object_array(v) for k, v in self.non_tensors.items()}
        n = len(self)
        for key, array in self.non_tensors.items():
            if len(array) != n:
                raise ValueError(f"non-tensor '{key}' has {len(array)} rows but the batch has {n}")

    @classmethod
    def from_dict(
        cls,
        tensors: dict[str, torch.Tensor] | None = None,
        non_tensors: dict[str, Iterable[Any]] | None = None,
        meta: dict[str, Any] | None = None,
    ) -> Batch:
        """Build a batch from plain dicts; the length comes from the tensors, else the non-tensors."""
        tensors = tensors or {}
        non_tensors = {k: _as_object_array(v) for k, v in (non_tensors or {}).items()}
        if tensors:
            n = next(iter(tensors.values())).shape[0]
        elif non_tensors:
            n = len(next(iter(non_tensors.values())))
        else:
            n = 0
        return cls(TensorDict(tensors, batch_size=[n]), non_tensors, dict(meta or {}))

    def __len__(self) -> int:
        return int(self.tensors.batch_size[0])

    def __getitem__(self, index: Index) -> Batch:
        if isinstance(index, int):
            index = slice(index, index + 1) if index != -1 else slice(index, None)
        rows = _index_array(index, len(self))
        tensor_rows = rows if isinstance(rows, slice) else torch.as_tensor(rows, dtype=torch.long)
        return Batch(
            self.tensors[tensor_rows],
            {k: v[rows] for k, v in self.non_tensors.items()},
            copy.deepcopy(self.meta),
        )

    def with_tensors(self, tensors: dict[str, torch.Tensor]) -> Batch:
        """The same rows with `tensors` added (or replaced); the other tensors are shared, not copied."""
        merged = self.tensors.clone(recurse=False)
        merged.update(tensors)
        return Batch(merged, self.non_tensors, self.meta)

    def keys(self) -> list[str]:
        return list(self.tensors.keys()) + list(self.non_tensors.keys())

    def chunk(self, n: int) -> list[Batch]:
        """Split into `n` equal chunks; a length not divisible by `n` is an error, never a truncation."""
        if n <= 0:
            raise ValueError(f"chunk count must be positive, got {n}")
        if len(self) % n != 0:
            raise ValueError(
                f"cannot chunk a batch of {len(self)} rows into {n} equal chunks; "
                f"pad it first with pad_to_multiple({n})"
            )
        size = len(self) // n
        return [self[i * size : (i + 1) * size] for i in range(n)]

    @staticmethod
    def concat(batches: Sequence[Batch]) -> Batch:
        """Join batches row-wise; their keys must match. `meta` comes from the first batch."""
        if not batches:
            raise ValueError("cannot concat an empty list of batches")
        first = batches[0]
        for other in batches[1:]:
            for kind, mine, theirs in (
                ("tensor", first.tensors.keys(), other.tensors.keys()),
                ("non-tensor", first.non_tensors, other.non_tensors),
            ):
                if set(theirs) != set(mine):
                    raise ValueError(
                        f"cannot concat batches with different {kind} keys: {sorted(mine)} vs {sorted(theirs)}"
                    )
        tensors = torch.cat([b.tensors for b in batches], dim=0)
        non_tensors = {k: np.concatenate([b.non_tensors[k] for b in batches]) for k in first.non_tensors}
        return Batch(tensors, non_tensors, copy.deepcopy(first.meta))

    def union(self, other: Batch) -> Batch:
        """Merge the keys of two batches of the same rows; a shared key must hold equal values."""
        if len(self) != len(other):
            raise ValueError(f"cannot union batches of {len(self)} and {len(other)} rows")
        tensors = self.tensors.clone(recurse=False)
        non_tensors, meta = dict(self.non_tensors), copy.deepcopy(self.meta)
        for kind, mine, theirs, same in (
            ("tensor", tensors, other.tensors, torch.equal),
            ("non-tensor", non_tensors, other.non_tensors, _object_arrays_equal),
            ("meta", meta, copy.deepcopy(other.meta), operator.eq),
        ):
            for key, value in theirs.items():
                if key in mine.keys() and not same(mine[key], value):
                    raise ValueError(f"union: {kind} '{key}' differs between the two batches")
                mine[key] = value
        return Batch(tensors, non_tensors, meta)

    def select(self, keys: Iterable[str]) -> Batch:
        """Keep only the named tensor and non-tensor keys; an unknown key is an error."""
        keys = list(keys)
        missing = [k for k in keys if k not in self.tensors.keys() and k not in self.non_tensors]
        if missing:
            raise KeyError(f"select: no such keys {missing}; the batch has {sorted(self.keys())}")
        tensor_keys = [k for k in keys if k in self.tensors.keys()]
        return Batch(
            self.tensors.select(*tensor_keys) if tensor_keys else TensorDict({}, batch_size=[len(self)]),
            {k: v for k, v in self.non_tensors.items() if k in keys},
            copy.deepcopy(self.meta),
        )

    def repeat(self, n: int, interleave: bool = True) -> Batch:
        """Repeat every row `n` times: interleaved gives a a b b, otherwise a b a b."""
        if n <= 0:
            raise ValueError(f"repeat count must be positive, got {n}")
        base = np.arange(len(self))
        rows = np.repeat(base, n) if interleave else np.tile(base, n)
        return self[rows]

    def pad_to_multiple(self, k: int) -> tuple[Batch, int]:
        """Append copies of the first rows until the length divides by `k`; returns (batch, pad)."""
        if k <= 0:
            raise ValueError(f"pad multiple must be positive, got {k}")
        if len(self) == 0:
            raise ValueError("cannot pad an empty batch: there is no row to repeat")
        pad = (-len(self)) % k
        if pad == 0:
            return self, 0
        rows = np.arange(pad) % len(self)
        return Batch.concat([self, self[rows]]), pad

    def unpad(self, pad: int) -> Batch:
        if pad < 0 or pad > len(self):
            raise ValueError(f"cannot remove {pad} padding rows from a batch of {len(self)}")
        return self if pad == 0 else self[: len(self) - pad]

    def to(self, device: str | torch.device) -> Batch:
        return Batch(self.tensors.to(device), self.non_tensors, self.meta)

    def __reduce__(self) -> tuple:
        """Ray pickles CPU tensors as numpy arrays (out of band, unlike torch.save), integers in the
        narrowest type that holds them, so more calls stay under the size Ray sends inline."""
        arrays = {key: _to_wire(value) for key, value in self.tensors.items()}
        size = list(self.tensors.batch_size)
        return (_from_wire, (arrays, size, self.tensors.device, self.non_tensors, self.meta))


# Tensor dtypes that numpy holds as they are; others (bfloat16, ...) go through torch's pickling.
_NUMPY_DTYPES = {
    torch.float64, torch.float32, torch.float16, torch.int64, torch.int32, torch.int16, torch.int8,
    torch.uint8, torch.bool,
}  # fmt: skip
_NARROW_INTS = (torch.int8, torch.int16, torch.int32)


def _to_wire(value: Any) -> Any:
    """A CPU tensor as (numpy array, dtype name), integers narrowed; anything else unchanged."""
    if not (
        isinstance(value, torch.Tensor)
        and value.device.type == "cpu"
        and value.dtype in _NUMPY_DTYPES
        and not (value.requires_grad or value.is_conj() or value.is_neg())
    ):
        return value
    dtype = str(value.dtype).removeprefix("torch.")
    if value.dtype == torch.int64 and value.numel():
        low, high = value.min().item(), value.max().item()
        narrow = next(
            (t for t in _NARROW_INTS if torch.iinfo(t).min <= low and high <= torch.iinfo(t).max), None
        )
        if narrow is not None:
            value = value.to(narrow)
    return value.numpy(), dtype


def _from_wire(arrays: dict[str, Any], size: list[int], device: Any, non_tensors: dict, meta: dict) -> Batch:
    tensors = {k: _from_array(*v) if isinstance(v, tuple) else v for k, v in arrays.items()}
    return Batch(TensorDict(tensors, batch_size=size, device=device), non_tensors, meta)


def _from_array(array: np.ndarray, dtype: str) -> torch.Tensor:
    # np.array copies: Ray hands back read-only arrays in its object store, and tensors are written.
    return torch.from_numpy(np.array(array)).to(getattr(torch, dtype))


def _object_arrays_equal(a: np.ndarray, b: np.ndarray) -> bool:
    return len(a) == len(b) and all(bool(np.all(x == y)) for x, y in zip(a, b, strict=True))


SAMPLING_KEY = "sampling"


def put_sampling(batch: Batch, params: SamplingParams) -> None:
    """Attach how the batch is sampled (generate_sequences, and the log-prob passes' temperature)."""
    batch.meta[SAMPLING_KEY] = params


def sampling_of(batch: Batch) -> SamplingParams | None:
    """The batch's sampling settings, typed (a dict is validated); None when never sampled (SFT)."""
    raw = batch.meta.get(SAMPLING_KEY)
    return None if raw is None else SamplingParams.model_validate(raw)


ENVIRONMENT_KEY = "environment"
PROMPT_LENGTH_KEY = "max_prompt_length"


def put_environment(batch: Batch, config: EnvironmentConfig | None) -> None:
    """Attach the multi-turn settings generate_sequences runs the rows with (None: single-turn)."""
    batch.meta[ENVIRONMENT_KEY] = config


def environment_of(batch: Batch) -> EnvironmentConfig | None:
    """The batch's multi-turn settings, typed (a dict is validated); None for single-turn rows."""
    raw = batch.meta.get(ENVIRONMENT_KEY)
    return None if raw is None else EnvironmentConfig.model_validate(raw)


def put_prompt_length(batch: Batch, max_prompt_length: int) -> None:
    """Attach the rollout layout's prompt width (data.max_prompt_length), the same on every rank."""
    if max_prompt_length <= 0:
        raise ValueError(f"max_prompt_length must be positive, got {max_prompt_length}")
    batch.meta[PROMPT_LENGTH_KEY] = int(max_prompt_length)


def prompt_length_of(batch: Batch) -> int | None:
    """The batch's prompt width, or None when it has none (then the longest prompt sets it)."""
    raw = batch.meta.get(PROMPT_LENGTH_KEY)
    return None if raw is None else int(raw)
