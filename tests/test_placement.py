"""Placement 'split': the rollout role on workers of its own, weights sent to them each step.

A GRPO job split (2 training ranks, 1 rollout worker) matches the colocated job step for step with
the same seed under greedy sampling, with advantages normalised over the batch (REINFORCE++) so that
identical greedy samples in a group still move the weights: the same sampled tokens (the stored samples, token spans
included), rewards and losses within 1e-5; so does a job with vLLM as the rollout engine. A rollout
worker that dies in the middle of a transfer is replaced (tests/test_rollout_replacement.py has the
kill between steps), and the event names it. The spec refuses rollout workers without 'split', naming the field.
"""

from __future__ import annotations

import re

import pytest
from pydantic import ValidationError

from controller import checkpoints
from controller.resource_pool import Capacity, Share, role_shares
from controller.sink import JsonlSink
from controller.trainer import Trainer
from schema.job import JobSpec
from tests.test_trainer import job_spec

TOL = 1e-5
SPLIT = {"placement": "split", "workers": 2, "rollout": {"workers": 1}}
# Metrics that measure time or the transfer itself (bytes and buckets differ by design: colocated,
# every rank copies into its own engine; split, rank 0 sends once).
NOT_COMPARED = ("timing_s/", "perf/", "weight_sync/")


def greedy_spec(**overrides) -> JobSpec:
    return job_spec(
        rollout={"n": 4, "max_new_tokens": 4, "temperature": 0.0},
        # greedy groups are identical: group-relative advantages would be zero and nothing would move
        algorithm={"advantage": "reinforce_pp"},
        trainer={"total_steps": 2, "val_every": 0, "samples_per_step": 16},
        checkpoint={"every": 0, "export_hf": False},
        resources={"workers": 2},
    ).merged(overrides)


def run_job(spec: JobSpec, workdir) -> JsonlSink:
    sink = JsonlSink(workdir)
    Trainer(spec, workdir, sink, name=workdir.name).run()
    return sink


def assert_same_steps(colocated: JsonlSink, split: JsonlSink) -> None:
    assert [r["step"] for r in split.history] == [r["step"] for r in colocated.history]
    for a, b in zip(colocated.history, split.history, strict=True):
        keys = {k for k in a["values"] if not k.startswith(NOT_COMPARED)}
        assert keys == {k for k in b["values"] if not k.startswith(NOT_COMPARED)}
        for key in keys:
            assert b["values"][key] == pytest.approx(a["values"][key], abs=TOL, rel=0), key
    assert split.history[-1]["values"]["weight_sync/version"] == len(split.history)
    # the first update moved the weights, so the second step compares generation after a real sync
    assert split.history[0]["values"]["actor/grad_norm"] > 0
    samples_a, samples_b = read_samples(colocated), read_samples(split)
    assert len(samples_a) == len(samples_b) == 2 * 16
    for a, b in zip(samples_a, samples_b, strict=True):
        assert a["reward"] == pytest.approx(b["reward"], abs=TOL)
        assert (a["turns"], a["spans"], a["tokens"]) == (b["turns"], b["spans"], b["tokens"])


def read_samples(sink: JsonlSink) -> list[dict]:
    import json

    lines = (sink.folder / "samples.jsonl").read_text().splitlines()
    return [row for line in lines for row in json.loads(line)["samples"]]


@pytest.fixture(autouse=True)
def _home(tmp_path, monkeypatch):
    monkeypatch.setenv("TANDEM_HOME", str(tmp_path / "home"))


def test_a_split_job_matches_the_colocated_job_step_for_step(ray_cluster, tmp_path):
    colocated = run_job(greedy_spec(), tmp_path / "colocated")
    split = run_job(greedy_spec(resources=SPLIT), tmp_path / "split")
    assert_same_steps(colocated, split)


@pytest.mark.slow  # make test keeps the hf split parity; tests/test_rollout_vllm.py the vllm engine
@pytest.mark.skipif(not __import__("importlib").util.find_spec("vllm"), reason="vllm is not installed")
def test_a_split_job_on_vllm_matches_the_colocated_one(ray_cluster, tmp_path):
    vllm = {"model": {"builtin": "qwen2-1m"}, "rollout": {"backend": "vllm"}, "resources": {"workers": 1}}
    colocated = run_job(greedy_spec(**vllm), tmp_path / "colocated")
    split = run_job(
        greedy_spec(**{**vllm, "resources": {"placement": "split", "workers": 1}}), tmp_path / "split"
    )
    assert_same_steps(colocated, split)


class KillRolloutAfterStep(JsonlSink):
    """A real sink that, once step `step` is recorded, arms the rollout worker to exit in the middle
    of the next weight transfer (RolloutWorker.exit_during_next_transfer)."""

    def __init__(self, folder, trainer_ref: list, step: int) -> None:
        super().__init__(folder)
        self.trainer_ref, self.step = trainer_ref, step

    def metrics(self, step: int, values: dict) -> None:
        super().metrics(step, values)
        if step == self.step:
            self.trainer_ref[0].job.groups.actor.rollout.group.exit_during_next_transfer([1])


def test_a_rollout_worker_dying_mid_transfer_is_replaced_and_named(ray_cluster, tmp_path):
    """The loss surfaces in the training rank's weight sync (its transfer fails, the receiver is dead):
    the rollout worker is replaced alone (controller/recovery.py), the replacement's transfer
    of the current weights is the step's sync, and the event names the worker that died."""
    spec = greedy_spec(
        resources={"placement": "split", "workers": 2},  # rank 1 gathers on with rank 0 after the failure
        trainer={"total_steps": 3, "samples_per_step": 0, "restart_backoff_s": 0},
        checkpoint={"every": 1, "keep_last": 3},
        rollout={"bucket_mb": 0.01},
    )
    holder: list = []
    sink = KillRolloutAfterStep(tmp_path, holder, step=1)
    trainer = Trainer(spec, tmp_path, sink, name="dies")
    holder.append(trainer)
    trainer.run()
    (event,) = [e for e in sink.events if e["kind"] == "rollout_replaced"]
    assert re.search(
        r"worker group 'dies-rollout', rank 0, method 'receive_(weights|bucket)'.*died",
        event["data"]["error"],
    )
    assert event["data"]["step"] == 2 and "restart" not in [e["kind"] for e in sink.events]
    assert [r["step"] for r in sink.history] == [1, 2, 3]
    # The new worker's first transfer was step 2's sync (its version 1), then step 3's.
    assert [r["values"]["weight_sync/version"] for r in sink.history] == [1.0, 1.0, 2.0]
    assert [step for step, _ in checkpoints.complete(tmp_path)] == [1, 2, 3]


def test_placement_settings_are_validated_and_counted():
    with pytest.raises(ValidationError) as err:
        JobSpec.model_validate({"resources": {"rollout": {"workers": 2}}})
    assert err.value.errors()[0]["loc"] == ("resources", "rollout")
    with pytest.raises(ValidationError, match="resources.rollout.workers must be a multiple"):
        JobSpec.model_validate(
            {
                "resources": {**SPLIT, "rollout": {"workers": 3}},
                "rollout": {"backend": "sglang", "tensor_parallel_size": 2},
            }
        )
    spec = JobSpec.model_validate(
        {"resources": {**SPLIT, "cpus_per_worker": 1, "rollout": {"workers": 3, "cpus_per_worker": 2}}}
    )
    assert role_shares(spec.resources, Capacity(cpus=2, gpus=0)) == {
        "training": Share(2, 1.0, 0.0),
        "rollout": Share(3, 2.0, 0.0),
    }  # explicit sizes are kept, whatever the cluster has
    assert spec.resources.rollout_workers.workers == 3
    assert (
        JobSpec.model_validate({"resources": {"placement": "split"}}).resources.rollout_workers.workers == 1
    )
    assert JobSpec().resources.rollout_workers is None


def test_rollout_workers_without_split_are_a_422_naming_the_field(unscheduled):
    body = {"model": {"builtin": "tiny-qwen2"}, "resources": {"rollout": {"workers": 2}}}
    with unscheduled.client() as http:
        response = http.post("/v1/jobs", json=body)
    assert response.status_code == 422, response.text
    assert response.json()["error"]["param"] == "resources.rollout"
