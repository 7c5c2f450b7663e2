"""A checkpoint folder is read as hostile input: `checkpoint.resume_from` may name a folder an owner wrote
or edited (a shared folder, a fork's source). Loading it must not run code pickled into its files, must
not read files outside it, and a truncated or edited file is refused naming the file.

One real FSDP engine (one process, gloo) saves a checkpoint; each test edits a copy of it and loads that.
"""

from __future__ import annotations

import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch

from engines.training.fsdp.checkpoint_reader import CheckpointError


class Plant:
    """A pickle that makes a folder when it is unpickled: code execution, made visible."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.mkdir, (str(self.marker),)


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    from engines.training.fsdp.engine import FSDPEngine
    from schema.engine import EngineConfig

    engine = FSDPEngine(EngineConfig(model_path=str(tiny_model_dir), optim={"lr": 1e-2}))
    engine.initialize()
    return engine


@pytest.fixture(scope="module")
def saved(engine, tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("saved") / "step_00000003"
    engine.save_checkpoint(str(folder), 3)
    return folder


@pytest.fixture
def copy(saved, tmp_path) -> Path:
    return Path(shutil.copytree(saved, tmp_path / "step_00000003"))


def test_a_clean_checkpoint_loads(engine, copy):
    assert engine.load_checkpoint(str(copy)) == 3


@pytest.mark.parametrize("name", ["rng_rank0.pt", "trainer_state.pt"])
def test_a_pickle_planted_in_a_torch_file_is_refused_and_never_run(engine, copy, tmp_path, name):
    marker = tmp_path / "ran"
    torch.save({"scheduler": Plant(marker), "python": Plant(marker)}, copy / name)
    with pytest.raises(CheckpointError, match=name):
        engine.load_checkpoint(str(copy))
    assert not marker.exists()


def test_a_pickle_planted_in_the_index_is_refused_and_never_run(engine, copy, tmp_path):
    marker = tmp_path / "ran"
    (copy / ".metadata").write_bytes(pickle.dumps([Plant(marker)]))
    with pytest.raises(CheckpointError, match=r"\.metadata"):
        engine.load_checkpoint(str(copy))
    assert not marker.exists()


def test_a_pickle_planted_in_a_saved_value_is_refused_and_never_run(engine, copy, tmp_path):
    import torch.distributed.checkpoint as dcp

    marker = tmp_path / "ran"
    state = engine._state()
    state["optim"]["param_groups"][0]["lr"] = Plant(marker)
    dcp.save(state, checkpoint_id=str(copy))
    assert not marker.exists()  # saving pickles it; only unpickling runs it
    with pytest.raises(CheckpointError, match="checkpoint"):
        engine.load_checkpoint(str(copy))
    assert not marker.exists()


def test_an_index_naming_a_file_outside_the_folder_is_refused(engine, copy, tmp_path):
    metadata = pickle.loads((copy / ".metadata").read_bytes())
    outside = tmp_path / "secret"
    shutil.copy(copy / "__0_0.distcp", outside)  # readable bytes: the old code would load them as weights
    for info in metadata.storage_data.values():
        info.relative_path = "../secret"
    (copy / ".metadata").write_bytes(pickle.dumps(metadata))
    with pytest.raises(CheckpointError, match="secret"):
        engine.load_checkpoint(str(copy))


def test_a_data_file_linked_to_one_outside_the_folder_is_refused(engine, copy, tmp_path):
    outside = tmp_path / "elsewhere.distcp"
    shutil.move(copy / "__0_0.distcp", outside)  # its bytes would load as weights through the link
    (copy / "__0_0.distcp").symlink_to(outside)
    with pytest.raises(CheckpointError, match="symbolic link"):
        engine.load_checkpoint(str(copy))


@pytest.mark.parametrize("name", ["__0_0.distcp", ".metadata", "trainer_state.pt", "rng_rank0.pt"])
def test_a_truncated_file_is_refused_naming_it(engine, copy, name):
    (copy / name).write_bytes(b"")
    with pytest.raises(CheckpointError, match=name.replace(".", r"\.")):
        engine.load_checkpoint(str(copy))


def test_edited_meta_with_a_wrong_type_is_refused_naming_it(engine, copy):
    (copy / "engine_meta.json").write_text('{"format_version": 1, "step": "three"}')
    with pytest.raises(CheckpointError, match="engine_meta.json"):
        engine.load_checkpoint(str(copy))


def test_a_missing_optimizer_file_is_refused_naming_it(engine, copy):
    (copy / "trainer_state.pt").unlink()
    with pytest.raises(CheckpointError, match="trainer_state.pt"):
        engine.load_checkpoint(str(copy))


def test_a_lora_checkpoint_with_targets_this_job_lacks_is_refused_not_half_loaded(tiny_model_dir, tmp_path):
    """Resumed with fewer LoRA targets, the checkpoint's other adapters would be dropped: a different model."""
    from engines.training.fsdp.engine import FSDPEngine
    from schema.engine import EngineConfig

    def lora_engine(targets: list[str]) -> FSDPEngine:
        lora = {"rank": 4, "target_modules": targets}
        engine = FSDPEngine(EngineConfig(model_path=str(tiny_model_dir), optim={"lr": 1e-2}, lora=lora))
        engine.initialize()
        return engine

    lora_engine(["q_proj", "v_proj"]).save_checkpoint(str(tmp_path / "both"), 2)
    with pytest.raises(CheckpointError, match=r"v_proj\.lora_A.*model\.lora"):
        lora_engine(["q_proj"]).load_checkpoint(str(tmp_path / "both"))
