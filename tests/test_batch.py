"""The Batch protocol: every operation keeps tensors, non-tensors and meta aligned."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch

from workers.batch import Batch


def make_batch(n: int = 6) -> Batch:
    return Batch.from_dict(
        tensors={"x": torch.arange(n * 2).reshape(n, 2), "y": torch.arange(n).float()},
        non_tensors={"uid": [f"u{i}" for i in range(n)], "gt": [[i, i + 1] for i in range(n)]},
        meta={"temperature": 1.0, "nested": {"step": 3}},
    )


def assert_aligned(batch: Batch) -> None:
    """Row i of every key describes the same sample: x = [2k, 2k+1], y = k, uid = 'uk', gt = [k, k+1]."""
    for i in range(len(batch)):
        k = int(batch.tensors["y"][i])
        assert batch.tensors["x"][i].tolist() == [2 * k, 2 * k + 1]
        assert batch.non_tensors["uid"][i] == f"u{k}"
        assert batch.non_tensors["gt"][i] == [k, k + 1]


def test_chunk_concat_round_trip():
    batch = make_batch(6)
    chunks = batch.chunk(3)
    assert [len(c) for c in chunks] == [2, 2, 2]
    assert chunks[1].tensors["y"].tolist() == [2.0, 3.0]
    assert chunks[2].non_tensors["uid"].tolist() == ["u4", "u5"]
    joined = Batch.concat(chunks)
    assert torch.equal(joined.tensors["x"], batch.tensors["x"])
    assert joined.non_tensors["uid"].tolist() == batch.non_tensors["uid"].tolist()
    assert_aligned(joined)


def test_chunk_not_divisible_is_a_clear_error():
    with pytest.raises(ValueError, match="cannot chunk a batch of 5 rows into 2"):
        make_batch(5).chunk(2)


def test_meta_is_deep_copied_into_every_chunk():
    batch = make_batch(4)
    a, b = batch.chunk(2)
    a.meta["temperature"] = 0.1
    a.meta["nested"]["step"] = 99
    assert b.meta == {"temperature": 1.0, "nested": {"step": 3}}
    assert batch.meta == {"temperature": 1.0, "nested": {"step": 3}}


def test_union_merges_and_rejects_conflicts():
    batch = make_batch(4)
    extra = Batch.from_dict(tensors={"z": torch.ones(4)}, non_tensors={"uid": [f"u{i}" for i in range(4)]})
    merged = batch.union(extra)
    assert set(merged.keys()) == {"x", "y", "z", "uid", "gt"}
    assert merged.tensors["z"].tolist() == [1.0] * 4
    conflicting = Batch.from_dict(tensors={"y": torch.zeros(4)})
    with pytest.raises(ValueError, match="tensor 'y' differs"):
        batch.union(conflicting)
    with pytest.raises(ValueError, match="non-tensor 'uid' differs"):
        batch.union(Batch.from_dict(tensors={"z": torch.ones(4)}, non_tensors={"uid": ["a", "b", "c", "d"]}))
    with pytest.raises(ValueError, match="meta 'temperature' differs"):
        batch.union(Batch.from_dict(tensors={"z": torch.ones(4)}, meta={"temperature": 0.5}))


def test_repeat_interleaved_and_tiled():
    batch = make_batch(3)
    inter = batch.repeat(2, interleave=True)
    assert inter.tensors["y"].tolist() == [0, 0, 1, 1, 2, 2]
    assert inter.non_tensors["uid"].tolist() == ["u0", "u0", "u1", "u1", "u2", "u2"]
    tiled = batch.repeat(2, interleave=False)
    assert tiled.tensors["y"].tolist() == [0, 1, 2, 0, 1, 2]
    assert_aligned(inter)
    assert_aligned(tiled)


def test_pad_to_multiple_and_unpad():
    batch = make_batch(5)
    padded, pad = batch.pad_to_multiple(4)
    assert (len(padded), pad) == (8, 3)
    assert padded.tensors["y"].tolist() == [0, 1, 2, 3, 4, 0, 1, 2]
    assert_aligned(padded)
    restored = padded.unpad(pad)
    assert torch.equal(restored.tensors["x"], batch.tensors["x"])
    assert restored.non_tensors["gt"].tolist() == batch.non_tensors["gt"].tolist()
    same, zero = batch.pad_to_multiple(5)
    assert zero == 0 and len(same) == 5


def test_select_keeps_only_named_keys():
    batch = make_batch(4)
    picked = batch.select(["x", "uid"])
    assert set(picked.keys()) == {"x", "uid"}
    assert picked.non_tensors["uid"].tolist() == ["u0", "u1", "u2", "u3"]
    with pytest.raises(KeyError, match="nope"):
        batch.select(["nope"])


def test_slicing_and_index_arrays():
    batch = make_batch(6)
    assert batch[1:3].tensors["y"].tolist() == [1, 2]
    rows = np.array([5, 0, 3])
    picked = batch[rows]
    assert picked.tensors["y"].tolist() == [5, 0, 3]
    assert picked.non_tensors["uid"].tolist() == ["u5", "u0", "u3"]
    assert_aligned(picked)
    assert batch[torch.tensor([4, 4])].non_tensors["gt"].tolist() == [[4, 5], [4, 5]]
    mask = np.array([True, False, True, False, False, True])
    assert batch[mask].tensors["y"].tolist() == [0, 2, 5]
    assert batch[2].tensors["y"].tolist() == [2]


def test_non_tensor_length_mismatch_is_rejected():
    with pytest.raises(ValueError, match="non-tensor 'uid' has 2 rows but the batch has 3"):
        Batch.from_dict(tensors={"x": torch.zeros(3)}, non_tensors={"uid": ["a", "b"]})


def test_concat_rejects_mismatched_keys():
    with pytest.raises(ValueError, match="different tensor keys"):
        Batch.concat([make_batch(2), make_batch(2).select(["x", "uid", "gt"])])


@pytest.mark.parametrize("protocol", [pickle.DEFAULT_PROTOCOL, 5])
def test_pickling_keeps_every_tensor_and_gives_writable_copies(protocol):
    batch = make_batch(6)
    batch.tensors["bf16"] = torch.randn(6, 3).to(torch.bfloat16)  # no numpy dtype: torch pickles it
    batch.tensors["strided"] = torch.arange(36).view(6, 6)[:, ::2]  # a non-contiguous view
    batch.tensors["flags"] = torch.tensor([True, False] * 3)
    # int64 travels narrowed to the type its values fit: int8 (x), int32 (ids), none (wide)
    batch.tensors["ids"] = torch.tensor([-70_000, 0, 1, 2, 3, 151_000])
    batch.tensors["wide"] = torch.tensor([2**40, -(2**40), 0, 1, 2, 3])
    buffers: list[pickle.PickleBuffer] = []
    data = pickle.dumps(batch, protocol=protocol, buffer_callback=buffers.append if protocol >= 5 else None)
    if protocol >= 5:  # the numeric tensors travelled out of band, as Ray sends them
        assert len(buffers) >= len(batch.tensors.keys()) - 2
        # Ray hands back read-only buffers; the tensors must still be writable copies.
        buffers = [pickle.PickleBuffer(bytes(b.raw())) for b in buffers]
    back = pickle.loads(data, buffers=buffers)
    assert sorted(back.tensors.keys()) == sorted(batch.tensors.keys())
    for key in batch.tensors.keys():
        assert back.tensors[key].dtype == batch.tensors[key].dtype
        assert torch.equal(back.tensors[key], batch.tensors[key]), key
    assert back.tensors.batch_size == batch.tensors.batch_size
    assert list(back.non_tensors["uid"]) == list(batch.non_tensors["uid"]) and back.meta == batch.meta
    back.tensors["x"].add_(1)  # written in place: its own memory
    assert torch.equal(back.tensors["x"], batch.tensors["x"] + 1)
