"""Reading a checkpoint folder as hostile input: `checkpoint.resume_from` may name a folder an owner wrote.

torch's distributed checkpoint pickles its index (`.metadata`) and its non-tensor values, and unpickling
can call anything. Here the index is unpickled with an allow-list of the classes it is made of, the data
files it names must lie in the folder, and every other file loads with `weights_only`. A file that cannot
be read is a `CheckpointError` naming it.
"""

from __future__ import annotations

import io
import pickle
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

# What `.metadata` is made of: the index's dataclasses, shapes, dtypes and layouts.
_INDEX_NAMES = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata", "MetadataIndex", "BytesStorageMetadata", "ChunkStorageMetadata",
        "TensorStorageMetadata", "TensorProperties", "StorageMeta", "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "pathlib": {"PosixPath"},
}  # fmt: skip
# np.random.get_state() holds an array: the RNG files need numpy's array rebuild besides tensors.
_RNG_GLOBALS = [np.ndarray, np.dtype, type(np.dtype(np.uint32)), np._core.multiarray._reconstruct]


class CheckpointError(ValueError):
    """A checkpoint file that is missing, truncated, edited or unsafe to load."""


class _IndexUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        dtype = module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        if not dtype and name not in _INDEX_NAMES.get(module, ()):
            raise pickle.UnpicklingError(f"{module}.{name} is not part of a checkpoint index")
        return super().find_class(module, name)


class SafeReader(dcp.FileSystemReader):
    """A FileSystemReader whose index is unpickled with the allow-list and names only files in the folder."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = Path(self.path) / ".metadata"
        with reading(path):
            metadata = _IndexUnpickler(io.BytesIO(path.read_bytes())).load()
            if not isinstance(metadata, Metadata):
                raise pickle.UnpicklingError(f"holds a {type(metadata).__name__}, not a checkpoint index")
        for info in (metadata.storage_data or {}).values():
            self._check_data_file(path, info)
        metadata.storage_meta = metadata.storage_meta or StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def _check_data_file(self, index: Path, info: Any) -> None:
        """The index's entry names a file of the folder that holds the bytes it points at."""
        name = str(getattr(info, "relative_path", ""))
        if Path(name).name != name or name in ("", ".", ".."):
            raise CheckpointError(f"checkpoint index {index} names '{name[:200]}', not a file of its folder")
        data = index.parent / name
        if data.is_symlink():  # a link could lead to another owner's files
            raise CheckpointError(
                f"checkpoint file {data} is a symbolic link: a checkpoint's files are its own"
            )
        size = data.stat().st_size if data.is_file() else -1
        if size < int(info.offset) + int(info.length):
            raise CheckpointError(f"checkpoint file {data} is missing or truncated "
                                  f"({max(size, 0)} bytes; its index needs {info.offset + info.length})")  # fmt: skip


class SafePlanner(dcp.DefaultLoadPlanner):
    """Non-tensor values (learning rates, step counts) load with `weights_only`."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        torch.load(value, weights_only=True)  # refuses a pickled callable before the planner's own load
        value.seek(0)
        super().load_bytes(read_item, value)


def load_state(state: dict, folder: Path) -> None:
    """`dcp.load` of `state` from `folder`, in place, through SafeReader and SafePlanner."""
    with reading(folder):
        dcp.load(state, storage_reader=SafeReader(str(folder)), planner=SafePlanner())


def load_torch_file(path: Path, rng: bool = False) -> Any:
    """A `torch.save`d file of plain values and tensors (and numpy arrays for an RNG state)."""
    with reading(path), torch.serialization.safe_globals(_RNG_GLOBALS if rng else []):
        return torch.load(path, weights_only=True)


@contextmanager
def reading(path: Path) -> Iterator[None]:
    """Turns a failure to read `path` into a CheckpointError naming it."""
    try:
        yield
    except CheckpointError:
        raise
    except (OSError, EOFError, RuntimeError, ValueError, TypeError, KeyError, AttributeError,
            pickle.UnpicklingError, CheckpointException) as err:  # fmt: skip
        if isinstance(err, CheckpointException):  # one per rank, each with its traceback
            err = next(iter(err.failures.values()))[0]
        raise CheckpointError(f"checkpoint file {path} cannot be loaded: {err!r}") from err
