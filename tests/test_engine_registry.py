"""Engines are selected by name: the registries, their probes, and the completed engine interfaces."""

from __future__ import annotations

import inspect

import pytest
from pydantic import ValidationError

from engines.rollout import ROLLOUT_ENGINES, RolloutEngine, build_rollout_engine, check_tensor_parallel
from engines.training.base import TrainEngine
from engines.training.registry import TRAIN_ENGINES, Registry, build_train_engine
from schema.engine import EngineConfig


def test_a_registered_builder_is_built_by_name_with_its_arguments():
    registry: Registry[tuple] = Registry("widget")

    @registry.register("plain")
    def build(path: str, scale: int = 1) -> tuple:
        return ("plain", path, scale)

    assert registry.names() == ["plain"]
    assert registry.build("plain", "/m", scale=3) == ("plain", "/m", 3)
    assert registry.available() == {"plain": None}


def test_a_failed_probe_is_reported_and_refuses_the_build():
    registry: Registry[str] = Registry("widget")
    built = []

    @registry.register("gpu-only", probe=lambda: "needs a GPU")
    def build() -> str:
        built.append(1)
        return "never"

    assert registry.available() == {"gpu-only": "needs a GPU"}
    with pytest.raises(ImportError, match="needs a GPU"):
        registry.build("gpu-only")
    assert built == []


def test_unknown_and_duplicate_names_are_refused():
    registry: Registry[str] = Registry("widget")
    registry.register("a")(lambda: "a")
    with pytest.raises(ValueError, match=r"unknown widget 'b': choose one of \['a'\]"):
        registry.build("b")
    with pytest.raises(ValueError, match="widget 'a' is already registered"):
        registry.register("a")(lambda: "again")


def test_the_training_engine_is_chosen_by_the_engine_config(tiny_model_dir):
    engine = build_train_engine(EngineConfig(model_path=str(tiny_model_dir), device="cpu"))
    assert isinstance(engine, TrainEngine) and type(engine).__name__ == "FSDPEngine"
    assert "fsdp" in TRAIN_ENGINES.names()
    with pytest.raises(ValidationError, match="engine") as err:
        EngineConfig(model_path="/m", engine="megatron")
    assert "unknown training engine 'megatron'" in str(err.value)


def test_the_engine_interfaces_declare_what_workers_call():
    abstract = TrainEngine.__abstractmethods__
    assert {"learning_rate", "set_learning_rate", "export_hf"} <= abstract
    assert "device" in inspect.get_annotations(TrainEngine)
    rollout_fields = inspect.get_annotations(RolloutEngine)
    assert {"dtype", "pad_token_id"} <= set(rollout_fields)


def test_the_hf_rollout_engine_exposes_dtype_and_pad_token_id(tiny_model_dir):
    import torch

    engine = build_rollout_engine("hf", tiny_model_dir, device="cpu", dtype="float32")
    assert engine.dtype == torch.float32 and isinstance(engine.pad_token_id, int)


def test_tensor_parallel_follows_what_the_backend_registered():
    check_tensor_parallel("sglang", 2)
    check_tensor_parallel("hf", 1)
    with pytest.raises(ValueError, match="'hf' runs on one device"):
        check_tensor_parallel("hf", 2)
    assert ROLLOUT_ENGINES.entry("sglang").tensor_parallel and not ROLLOUT_ENGINES.entry("hf").tensor_parallel
