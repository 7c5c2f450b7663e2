"""engines/models/model_folder.py: a built model folder appears whole or not at all, and a build that loses
the race to another process keeps the winner's folder."""

from __future__ import annotations

import json
import multiprocessing
from pathlib import Path

from engines.models.model_folder import build_atomically, install, staging_folder


def _write(folder: Path, content: str) -> None:
    (folder / "weights.bin").write_text(content)
    (folder / "marker.json").write_text(json.dumps({"content": content}))


def _current(content: str):
    def check(folder: Path) -> bool:
        marker = folder / "marker.json"
        return marker.exists() and json.loads(marker.read_text()) == {"content": content}

    return check


def test_a_missing_folder_is_renamed_into_place(tmp_path):
    target = tmp_path / "models" / "m"
    staging = staging_folder(target)
    _write(staging, "v1")
    assert install(staging, target, _current("v1")) == target
    assert (target / "weights.bin").read_text() == "v1"
    assert sorted(p.name for p in target.parent.iterdir()) == ["m"]  # no staging folder left


def test_a_current_folder_built_by_another_process_is_kept(tmp_path):
    target = tmp_path / "m"
    target.mkdir()
    _write(target, "v1")
    inode = (target / "weights.bin").stat().st_ino
    staging = staging_folder(target)
    _write(staging, "v1")
    install(staging, target, _current("v1"))
    assert (target / "weights.bin").stat().st_ino == inode  # the winner's file, untouched
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]


def test_a_stale_or_partial_folder_is_replaced_whole(tmp_path):
    target = tmp_path / "m"
    target.mkdir()
    (target / "weights.bin").write_text("half a file, no marker")
    staging = staging_folder(target)
    _write(staging, "v2")
    install(staging, target, _current("v2"))
    assert (target / "weights.bin").read_text() == "v2" and _current("v2")(target)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]


def test_a_failed_build_leaves_nothing_behind(tmp_path):
    target = tmp_path / "m"

    def broken(staging: Path) -> None:
        (staging / "weights.bin").write_text("partial")
        raise RuntimeError("out of disk")

    try:
        build_atomically(target, "marker.json", {"content": "v1"}, broken)
    except RuntimeError as err:
        assert "out of disk" in str(err)
    else:
        raise AssertionError("the build's error was swallowed")
    assert list(tmp_path.iterdir()) == []


def _build_tiny(root: str) -> str:
    from engines.models.tiny_models import build_builtin_model

    folder = build_builtin_model("tiny-qwen2", root)
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(folder)  # loads whole, whichever process built it
    return str(folder)


def test_processes_building_the_same_model_at_once_all_load_it(tmp_path):
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(3) as pool:
        folders = pool.map(_build_tiny, [str(tmp_path)] * 3, chunksize=1)
    assert len(set(folders)) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny-qwen2"]  # no staging folders left
