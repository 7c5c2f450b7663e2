"""A split placement's rollout worker killed mid-job is replaced alone (controller/recovery.py).

A GRPO job with `resources.placement: split` (one training rank, one rollout worker) has its rollout
worker's process killed with SIGKILL once step 1 is recorded: step 2's generation fails, a new
rollout worker is started and sent the current weights, and step 2 generates its prompts again. The
training rank keeps its process (same pid before and after), the job succeeds, the replacement is a
`rollout_replaced` event and `job/rollout_replacements`, no whole-job restart happens, and every
step's metrics and samples equal those of the same job run without the kill (sampled, seeded: the
retried step drew the same prompts and the same seeds). The default transfer strategy (collective)
runs in `make test`, the object store in the slow suite. A replacement counts against
trainer.max_restarts but is not a restart; one that failed is taken back (the restart counts it).
"""

from __future__ import annotations

import os
import re
import signal

import pytest

from controller.recovery import Recovery, RestartsExhausted, WorkerLost, worker_pids
from controller.sink import JsonlSink
from controller.trainer import Trainer
from schema.job import JobSpec
from schema.training import TrainerSpec
from tests.test_placement import read_samples
from tests.test_trainer import job_spec

NOT_COMPARED = ("timing_s/", "perf/", "weight_sync/", "job/")
SPLIT = {"placement": "split", "workers": 1, "cpus_per_worker": 1, "rollout": {"workers": 1}}


def split_spec(transfer: str) -> JobSpec:
    return job_spec(
        # sampled (temperature 1) with the step's seeds
        rollout={"n": 4, "max_new_tokens": 4, "weight_transfer": transfer},
        trainer={"total_steps": 3, "val_every": 0, "samples_per_step": 16, "restart_backoff_s": 0},
        checkpoint={"every": 0, "export_hf": False},
        resources=SPLIT,
    )


class KillRollout(JsonlSink):
    """A real sink that SIGKILLs the rollout worker of `rank` once step `step` is recorded, and notes
    every worker's pid then and one step later."""

    def __init__(self, folder, step: int, rank: int = 0) -> None:
        super().__init__(folder)
        self.step, self.rank = step, rank
        self.trainer: Trainer | None = None
        self.pids: dict[int, dict[str, list[int]]] = {}
        self.killed: int | None = None

    def metrics(self, step: int, values: dict) -> None:
        super().metrics(step, values)
        if step in (self.step, self.step + 1):
            self.pids[step] = worker_pids(self.trainer.job.groups)
        if step == self.step and self.killed is None:
            self.killed = self.pids[step]["rollout"][self.rank]
            os.kill(self.killed, signal.SIGKILL)


@pytest.fixture(autouse=True)
def _home(tmp_path, monkeypatch):
    monkeypatch.setenv("TANDEM_HOME", str(tmp_path / "home"))


# Both transfers in make test-slow; in make test a rollout worker lost mid-transfer is replaced and named by
# tests/test_placement.py::test_a_rollout_worker_dying_mid_transfer_is_replaced_and_named.
@pytest.mark.parametrize(
    "transfer", [pytest.param(t, marks=pytest.mark.slow) for t in ("collective", "object_store")]
)
def test_a_killed_rollout_worker_is_replaced_while_the_training_rank_keeps_its_process(
    ray_cluster, tmp_path, transfer
):
    sink = KillRollout(tmp_path / "killed", step=1)
    trainer = Trainer(split_spec(transfer), tmp_path / "killed", sink, name="rollkill")
    sink.trainer = trainer
    trainer.run()

    before, after = sink.pids[1], sink.pids[2]
    assert after["actor"] == before["actor"]  # the training rank kept its process
    assert after["rollout"] != before["rollout"]  # the rollout worker is a new one
    kinds = [e["kind"] for e in sink.events]
    assert "restart" not in kinds and kinds.count("rollout_replaced") == 1
    (event,) = [e for e in sink.events if e["kind"] == "rollout_replaced"]
    data = event["data"]
    assert (data["cause"], data["group"], data["rank"], data["step"]) == ("died", "rollkill-rollout", 0, 2)
    assert data["pids"] == after["rollout"] and data["replacement"] == 1
    assert "method 'generate_sequences'" in data["error"] and "died" in data["error"]
    assert event["message"].startswith("replaced a rollout worker (1/3): worker rank 0 died")
    history = sink.history
    assert [r["step"] for r in history] == [1, 2, 3]  # step 2 retried, recorded once
    assert [r["values"]["job/rollout_replacements"] for r in history] == [0.0, 1.0, 1.0]
    assert [r["values"]["job/restarts"] for r in history] == [0.0, 0.0, 0.0]

    # The same job without the kill: the retried step drew the same prompts and seeds.
    plain = JsonlSink(tmp_path / "plain")
    Trainer(split_spec(transfer), tmp_path / "plain", plain, name="rollplain").run()
    for a, b in zip(plain.history, history, strict=True):
        keys = {k for k in a["values"] if not k.startswith(NOT_COMPARED)}
        assert keys == {k for k in b["values"] if not k.startswith(NOT_COMPARED)}
        for key in keys:
            assert b["values"][key] == pytest.approx(a["values"][key], abs=1e-6, rel=0), key
    samples_a, samples_b = read_samples(plain), read_samples(sink)
    assert len(samples_a) == len(samples_b) == 3 * 16
    assert [s["tokens"] for s in samples_a] == [s["tokens"] for s in samples_b]


def test_a_replacement_counts_against_the_restart_budget_but_is_not_a_restart(tmp_path):
    recovery = Recovery(TrainerSpec(max_restarts=1))
    lost = WorkerLost("died", "rollout gone", "job-rollout", 0)
    recovery.begin_replacement(lost)
    assert recovery.status["message"] == "replacing a rollout worker (1/1): worker rank 0 died"
    assert recovery.status["phase"] == "replacing rollout worker"
    sink = JsonlSink(tmp_path)
    recovery.replaced_rollout(lost, sink, 2, pids=[123])
    assert recovery.status is None and (recovery.replaced, recovery.restarts, recovery.attempt) == (1, 0, 1)
    (event,) = sink.events
    assert event["kind"] == "rollout_replaced" and event["data"]["pids"] == [123]
    with pytest.raises(RestartsExhausted, match=r"lost a worker 2 time\(s\).*\[attempt 2\] again"):
        recovery.begin_replacement(WorkerLost("died", "again", "job-rollout", 0))

    # A replacement that failed is taken back: the whole-job restart after it counts the loss once.
    recovery = Recovery(TrainerSpec(max_restarts=1))
    recovery.begin_replacement(lost)
    recovery.replacement_failed()
    assert (recovery.used, recovery.replaced, recovery.status) == (0, 0, None)
    recovery.begin(lost, sink, 2, 0, None)
    assert recovery.status["message"] == "restarting (1/1): worker rank 0 died" and recovery.attempt == 2


# Over 25 s here (each attempt starts its workers), so in make test-slow; make test names a lane's
# worker by tests/test_worker_group.py::test_dead_actor_fails_the_next_call_quickly.
@pytest.mark.slow
def test_a_killed_lane_worker_of_an_async_job_is_named_by_its_group_and_rank_and_the_job_restarts(
    ray_cluster, tmp_path
):
    """Async, one lane per rollout worker: the worker of lane 1 is killed once step 1 is recorded. Its
    loss (met by its lane's call or by the next weight sync, whichever comes first) names rank 1 of the
    rollout group with its pid, and the job restarts (async replaces no worker alone, see
    Trainer._replace_rollout) from step 1's checkpoint and finishes."""
    spec = job_spec(
        rollout={"n": 2, "max_new_tokens": 2},
        trainer={
            "mode": "async",
            "rollout_lanes": "per_worker",
            "max_staleness": 1,
            "total_steps": 3,
            "prompts_per_step": 2,
            "val_every": 0,
            "samples_per_step": 0,
            "restart_backoff_s": 0,
        },
        checkpoint={"every": 1, "export_hf": False},
        resources={**SPLIT, "rollout": {"workers": 2}},
    )
    sink = KillRollout(tmp_path, step=1, rank=1)
    trainer = Trainer(spec, tmp_path, sink, name="lanekill")
    sink.trainer = trainer
    trainer.run()

    assert [e["kind"] for e in sink.events].count("restart") == 1
    (event,) = [e for e in sink.events if e["kind"] == "restart"]
    data = event["data"]
    assert (data["cause"], data["group"], data["rank"], data["resume_step"]) == (
        "died",
        "lanekill-rollout",
        1,
        1,
    )
    named = rf"worker group 'lanekill-rollout', rank 1, method '\w+': the worker actor died \(pid {sink.killed} on "
    assert re.search(named, data["error"]), data["error"]
    assert event["message"].startswith("restarting (1/3): worker rank 1 died")
    assert [r["step"] for r in sink.history] == [1, 2, 3]  # resumed after step 1 and finished
