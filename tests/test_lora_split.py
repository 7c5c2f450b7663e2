"""LoRA with placement 'split': the adapter alone goes to a rollout worker of its own.

A LoRA GRPO job split (1 training rank, 1 rollout worker on the hf engine) matches the colocated
LoRA job with the same seed step for step under greedy sampling: the same sampled tokens, rewards
and losses within 1e-5. Each sync moves exactly the adapter (`weight_sync/bytes` = rank x (in + out)
x 4 bytes summed over the adapted layers, read from the model's safetensors headers), and the probe
after it passes (the rollout worker's log-probs of its greedy probe sequence match the trainer's).
"""

from __future__ import annotations

import pytest
import torch

from engines.models.tiny_models import build_builtin_model
from engines.training.lora_targets import linear_layers
from engines.transfer.adapter import AdapterSyncError, default_tolerance
from engines.transfer.base import TransferStats
from schema.job import JobSpec
from tests.test_placement import assert_same_steps, greedy_spec, run_job
from workers.transfer_choice import RemoteAdapterTransfer, RolloutPeers

RANK = 4
# Seeded sampling at temperature 1, not greedy: greedy groups are identical, their advantages zero,
# and the adapter would never move from the base (a sync that drops it would go unnoticed).
LORA = {
    "model": {"builtin": "tiny-qwen2", "lora": {"rank": RANK, "alpha": 8.0}},
    "optim": {"lr": 3e-2},
    "rollout": {"n": 4, "max_new_tokens": 4, "temperature": 1.0},
}


@pytest.fixture(autouse=True)
def _home(tmp_path, monkeypatch):
    monkeypatch.setenv("TANDEM_HOME", str(tmp_path / "home"))


def test_a_split_lora_job_matches_the_colocated_one_and_syncs_only_the_adapter(ray_cluster, tmp_path):
    colocated = run_job(greedy_spec(**LORA, resources={"workers": 1}), tmp_path / "colocated")
    split = run_job(
        greedy_spec(**LORA, resources={"placement": "split", "workers": 1, "rollout": {"workers": 1}}),
        tmp_path / "split",
    )
    assert_same_steps(colocated, split)
    assert split.history[0]["values"]["actor/grad_norm"] > 0  # the adapter moves off the base

    # The adapter's size, computed from the base's linear layers (all-linear: every one of them).
    layers = linear_layers(build_builtin_model("tiny-qwen2", tmp_path / "models"))
    adapter_bytes = sum(RANK * (out + inp) * 4 for out, inp in layers.values())
    for row in split.history:
        values = row["values"]
        assert values["weight_sync/bytes"] == adapter_bytes
        assert values["lora/trainable_params"] == adapter_bytes // 4
        assert 0 <= values["weight_sync/probe_max_abs_diff"] <= 1e-4  # fp32: the bound


def test_a_probe_past_the_tolerance_names_the_rollout_worker():
    """The sender's check, fed a worker whose log-probs are off (an adapter that never loaded)."""
    transfer = RemoteAdapterTransfer(
        RolloutPeers([], "job-rollout", 1.0), {}, default_tolerance(torch.float32)
    )
    moved = TransferStats(
        bytes=400, seconds=0.1, buckets=1, tensors=2, max_bucket_bytes=400, weight_version=3
    )
    assert transfer.checked(moved, [1e-6, 2e-5]).metrics()["weight_sync/probe_max_abs_diff"] == 2e-5
    with pytest.raises(AdapterSyncError, match="rollout worker rank 1 of 'job-rollout'") as err:
        transfer.checked(moved, [1e-6, 0.5])
    assert "adapter sync 3" in str(err.value)


@pytest.mark.slow
def test_a_split_lora_job_with_two_training_ranks_and_two_rollout_workers(ray_cluster, tmp_path):
    """Every training rank runs the probe's forward (broadcast from rank 0); each rollout worker is
    probed. Two rollout workers so that the replicas (and their sampling seeds) match the colocated
    job's two ranks."""
    colocated = run_job(greedy_spec(**LORA, resources={"workers": 2}), tmp_path / "colocated")
    split = run_job(
        greedy_spec(**LORA, resources={"placement": "split", "workers": 2, "rollout": {"workers": 2}}),
        tmp_path / "split",
    )
    assert_same_steps(colocated, split)
    for row in split.history:
        assert row["values"]["weight_sync/probe_max_abs_diff"] <= 1e-4


@pytest.mark.slow
@pytest.mark.skipif(not __import__("importlib").util.find_spec("vllm"), reason="vllm is not installed")
def test_a_split_lora_job_on_vllm_matches_the_colocated_one(ray_cluster, tmp_path):
    """vLLM loads the adapter from a RAM folder in the rollout worker's process, as colocated."""
    # rank 4, which vLLM's max_lora_rank (1, 8, 16, ...) does not take: the engine asks for 8
    vllm = {**LORA, "model": {**LORA["model"], "builtin": "qwen2-1m"}}
    vllm["rollout"] = {**LORA["rollout"], "backend": "vllm"}
    colocated = run_job(greedy_spec(**vllm, resources={"workers": 1}), tmp_path / "colocated")
    split = run_job(greedy_spec(**vllm, resources={"placement": "split", "workers": 1}), tmp_path / "split")
    assert_same_steps(colocated, split)
    assert split.history[0]["values"]["actor/grad_norm"] > 0
    for row in split.history:
        assert row["values"]["weight_sync/probe_max_abs_diff"] <= default_tolerance(torch.float32)


def test_the_submission_check_takes_model_lora_with_a_split_placement(tmp_path):
    """It was a 422 naming resources.placement; now the LoRA checks run as for a colocated job (an
    unknown target module is still refused, naming model.lora.target_modules)."""
    from api.errors import APIError
    from api.settings import ServeSettings
    from api.validation import Checker
    from service.files import FileStore
    from service.store import JobStore

    checker = Checker(
        ServeSettings(), tmp_path, FileStore(tmp_path / "files"), JobStore(tmp_path / "tandem.db")
    )
    split = {"placement": "split", "workers": 1, "rollout": {"workers": 2}}
    spec = JobSpec.model_validate(
        {"model": {"builtin": "tiny-qwen2", "lora": {"rank": RANK}}, "resources": split}
    )
    checker.lora(spec)
    bad = spec.merged({"model": {"lora": {"target_modules": ["nope_proj"]}}})
    with pytest.raises(APIError) as err:
        checker.lora(bad)
    assert err.value.param == "model.lora.target_modules"
