"""Jobs that survive their workers (controller/recovery.py), against a live service on a real Ray.

A worker process is killed with SIGKILL (its pid asked from the job's controller actor) at a step
drawn from a seed: the job restarts from its last checkpoint, stores every step once, marks what
the re-run recorded with attempt 2, and ends with the weights of a run that was never interrupted,
bit for bit (CPU, one rank of one thread). `max_restarts: 0` fails at once; workers killed as soon
as they start exhaust the restarts and fail the job with every error listed; an error of the job's
own (a rank that raised) is never retried. The first seed runs in the service (what the store
keeps), the others in a Trainer in this process (cheaper: no controller actor to start).
"""

from __future__ import annotations

import contextlib
import os
import random
import re
import signal
import threading
import time

import pytest
import ray
import torch
from ray.exceptions import RayActorError
from safetensors.torch import load_file

from api.cli_jobs import shown_status
from controller.recovery import RestartsExhausted, WorkerLost, worker_lost
from controller.recovery import worker_pids as recovery_worker_pids
from controller.resource_pool import ResourcePoolError
from controller.sink import JsonlSink
from controller.trainer import Trainer
from controller.worker_group import WorkerGroupError
from engines.transfer.base import TransferError, TransferTimeout
from schema.job import JobSpec
from tests.api_util import TERMINAL, tiny_job, wait_for, wait_for_step
from workers import remote

TOTAL = 5


def recovery_job(**overrides) -> dict:
    base = {
        "trainer": {"total_steps": TOTAL, "prompts_per_step": 4, "val_every": 0, "restart_backoff_s": 0},
        "checkpoint": {"every": 2, "keep_last": 2, "export_hf": True},
        "resources": {"workers": 1, "cpus_per_worker": 1},  # one torch thread: the same sums every run
        "metadata": {"suite": "recovery"},
    }
    spec = tiny_job(**base)
    for key, value in overrides.items():
        spec[key] = {**spec.get(key, {}), **value} if isinstance(value, dict) else value
    return spec


def controller(live, job_id: str, timeout_s: float = 60) -> ray.actor.ActorHandle:
    """The job's controller actor, once the scheduler started it."""
    deadline = time.time() + timeout_s
    while (actor := live.service.scheduler.controller(job_id)) is None:
        assert time.time() < deadline, f"job {job_id} was not started within {timeout_s}s"
        time.sleep(0.1)
    return actor


def worker_pids(live, job_id: str, timeout_s: float = 120) -> list[int]:
    """The job's worker processes, asked from its controller actor once its workers are up."""
    actor = controller(live, job_id)
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        pids = ray.get(actor.worker_pids.remote(), timeout=60)
        if pids:
            return [pid for ranks in pids.values() for pid in ranks]
        time.sleep(0.2)
    raise AssertionError(f"job {job_id} started no workers within {timeout_s}s")


def final_weights(workdir: str) -> dict[str, torch.Tensor]:
    return load_file(os.path.join(workdir, "export", "model.safetensors"))


@pytest.fixture(scope="module")
def uninterrupted(ray_cluster, tmp_path_factory) -> dict[str, torch.Tensor]:
    """The same job run straight through, in this process (the trainer the service runs)."""
    workdir = tmp_path_factory.mktemp("uninterrupted")
    Trainer(JobSpec.model_validate(recovery_job()), workdir, JsonlSink(workdir), name="uninterrupted").run()
    return final_weights(str(workdir))


def kill_step(seed: int) -> int:
    """The step after which the worker is killed: 1 for seed 0, 0 for 1 (slow: 2, 1, 1, 1); two
    steps or more are still to run."""
    return random.Random(1000 + seed).randint(0, TOTAL - 3)


def test_a_killed_worker_costs_only_the_steps_since_the_checkpoint(live, api, uninterrupted):
    """Seed 0, in the service: the store keeps one row per step, the re-run's rows replace the lost
    attempt's, and samples, events and logs of the second attempt say so."""
    kill_after = kill_step(0)
    job = api.post("/v1/jobs", json=recovery_job()).json()
    (pid,) = worker_pids(live, job["id"])  # asked first: a busy worker answers between two calls
    if kill_after:
        wait_for_step(api, job["id"], kill_after)
    os.kill(pid, signal.SIGKILL)
    done = wait_for(api, job["id"], TERMINAL)
    assert done["status"] == "succeeded", done["error"]
    assert done["restart"] is None and done["latest_metrics"]["job/restarts"] == 1.0

    rows = api.get(f"/v1/jobs/{job['id']}/metrics", params={"limit": 100}).json()["data"]
    assert [r["step"] for r in rows] == list(range(1, TOTAL + 1))  # every step stored once
    events = api.get(f"/v1/jobs/{job['id']}/events", params={"limit": 1000}).json()["data"]
    (restart,) = [e for e in events if e["kind"] == "restart"]
    data = restart["data"]
    assert data["rank"] == 0 and data["cause"] == "died" and data["attempt"] == 2
    assert data["resume_step"] in (0, 2, 4, TOTAL)  # the start, or a checkpoint (every 2, and the end)
    assert 0 <= data["step"] - data["resume_step"] <= 2  # it lost at most the steps since that checkpoint
    # The rows after the checkpoint are the second attempt's: the first attempt's were replaced.
    assert [r["values"]["job/restarts"] for r in rows] == [
        float(r["step"] > data["resume_step"]) for r in rows
    ]
    assert restart["message"].startswith("restarting (1/3): worker rank 0 died; resuming from")
    after = events[events.index(restart) + 1 :]
    assert [e["kind"] for e in after if e["kind"] == "resumed"] or data["resume_step"] == 0
    assert all(e["data"].get("attempt") == 2 for e in after if e["kind"] != "succeeded")  # (the service's)
    samples = api.get(f"/v1/jobs/{job['id']}/samples", params={"limit": 200}).json()["data"]
    assert {s.get("attempt", 1) for s in samples if s["step"] > data["resume_step"]} >= {2}
    logs = api.get(f"/v1/jobs/{job['id']}/logs", params={"tail": 2000}).json()["data"]
    assert any(line["line"].startswith("[attempt 2] ") for line in logs)

    weights = final_weights(done["outputs"]["workdir"])
    assert weights.keys() == uninterrupted.keys()
    assert all(torch.equal(weights[k], uninterrupted[k]) for k in weights)  # bitwise, on CPU


class InProcess:
    """The job's Trainer run in a thread of this process (no controller actor to start: cheaper)."""

    def __init__(self, workdir, **overrides) -> None:
        self.sink = JsonlSink(workdir)
        self.trainer = Trainer(
            JobSpec.model_validate(recovery_job(**overrides)), workdir, self.sink, "inproc"
        )
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run)
        self.thread.start()

    def _run(self) -> None:
        try:
            self.trainer.run()
        except BaseException as err:
            self.error = err

    def pids(self, timeout_s: float = 120) -> list[int]:
        """The worker processes of the current attempt, once they are up."""
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            job = self.trainer.job
            if job is not None:
                return [pid for ranks in recovery_worker_pids(job.groups).values() for pid in ranks]
            time.sleep(0.05)
        raise AssertionError(f"no workers within {timeout_s}s")

    def wait(self, timeout_s: float = 300) -> None:
        self.thread.join(timeout_s)
        assert not self.thread.is_alive(), f"the job did not end within {timeout_s}s"


@pytest.mark.parametrize("seed", [1, *(pytest.param(s, marks=pytest.mark.slow) for s in range(2, 6))])
def test_a_killed_worker_in_the_trainer_ends_with_the_uninterrupted_weights(
    ray_cluster, tmp_path, uninterrupted, seed
):
    job = InProcess(tmp_path)
    (pid,) = job.pids()
    while job.trainer.completed_steps < kill_step(seed) and job.thread.is_alive():
        time.sleep(0.02)
    os.kill(pid, signal.SIGKILL)
    job.wait()
    assert job.error is None, job.error
    (restart,) = [e for e in job.sink.events if e["kind"] == "restart"]
    resume = restart["data"]["resume_step"]
    assert 0 <= restart["data"]["step"] - resume <= 2
    history = job.sink.history
    assert [r["step"] for r in history] == list(range(1, TOTAL + 1))  # one row per step
    assert [r["values"]["job/restarts"] for r in history] == [float(r["step"] > resume) for r in history]
    weights = final_weights(str(tmp_path))
    assert all(torch.equal(weights[k], uninterrupted[k]) for k in uninterrupted)  # bitwise, on CPU


def test_max_restarts_0_fails_at_once_with_the_error(ray_cluster, tmp_path):
    job = InProcess(tmp_path, trainer={"max_restarts": 0})
    (pid,) = job.pids()
    os.kill(pid, signal.SIGKILL)
    job.wait()
    assert isinstance(job.error, RestartsExhausted)
    assert "more than trainer.max_restarts (0)" in str(job.error)
    assert "[attempt 1] worker group" in str(job.error) and "the worker actor died" in str(job.error)
    assert "restart" not in [e["kind"] for e in job.sink.events]


# make test-slow; in make test the restart budget is held by test_max_restarts_0_fails_at_once_with_the_error
# and tests/test_rollout_replacement.py::test_a_replacement_counts_against_the_restart_budget_but_is_not_a_restart.
@pytest.mark.slow
def test_workers_that_die_on_every_start_exhaust_the_restarts(live, api):
    """Every worker process is killed as soon as it answers: one restart, then the job fails listing
    both losses. The backoff keeps the restart on view long enough to read it."""
    job = api.post("/v1/jobs", json=recovery_job(trainer={"max_restarts": 1, "restart_backoff_s": 1})).json()
    stop = threading.Event()
    killed: list[int] = []

    def kill_every_worker() -> None:
        actor = controller(live, job["id"])
        while not stop.is_set():
            try:
                pids = ray.get(actor.worker_pids.remote(), timeout=30)
            except Exception:  # the workers are going down, or the job ended
                pids = {}
            for pid in [p for ranks in pids.values() for p in ranks if p not in killed]:
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
            time.sleep(0.1)

    killer = threading.Thread(target=kill_every_worker, daemon=True)
    killer.start()
    try:
        shown = None
        deadline = time.time() + 120
        while shown is None and time.time() < deadline:
            view = api.get(f"/v1/jobs/{job['id']}").json()
            if view["restart"]:
                shown = view
            assert view["status"] not in TERMINAL
            time.sleep(0.1)
        assert shown is not None and shown["status"] == "running"
        assert shown["restart"]["message"] == "restarting (1/1): worker rank 0 died"
        assert shown_status(shown).startswith("restarting (1/1): worker rank 0 died (")  # tandem status/list
        done = wait_for(api, job["id"], TERMINAL)
    finally:
        stop.set()
        killer.join(timeout=60)
    assert done["status"] == "failed" and done["restart"] is None and len(killed) == 2
    assert "the job lost a worker 2 time(s), more than trainer.max_restarts (1)" in done["error"]
    assert done["error"].count("the worker actor died") == 2
    assert "[attempt 1] " in done["error"] and "[attempt 2] " in done["error"]


def test_an_error_of_the_job_itself_is_not_retried(ray_cluster, tmp_path):
    """The rank raises (multi-turn rollouts asked of a model without a chat template): the job's own
    error, whatever the budget. The ranks are pinged first (a rank may raise because a peer died
    under it): all answer, so it fails."""
    spec = JobSpec.model_validate(
        recovery_job(rollout={"environment": "tests.multiturn_envs:ScriptedEnv"}, trainer={"max_restarts": 3})
    )
    sink = JsonlSink(tmp_path)
    with pytest.raises(WorkerGroupError, match="has none: use a chat model") as failed:
        Trainer(spec, tmp_path, sink, name="raises").run()
    assert failed.value.kind == "raised" and failed.value.method == "generate_sequences"
    assert "restart" not in [e["kind"] for e in sink.events]


def test_a_hung_rank_is_named_and_spends_the_restart_budget_as_a_lost_worker(
    ray_cluster, tmp_path, monkeypatch
):
    """Rank 1 of two SIGSTOPped after its first step (SFT: every call is collective). Rank 0's collective
    times out after trainer.collective_timeout_s; rank 1, silent past the grace, is named hung with its pid
    and the job is restarted as for a dead worker: with max_restarts 0 that is at once RestartsExhausted
    (the job's own error would have ended it unretried), and the stopped process is killed."""
    monkeypatch.setattr(remote, "HUNG_GRACE_S", 2.0)  # wait_all runs in this process (InProcess)
    job = InProcess(
        tmp_path,
        method="sft",
        trainer={"total_steps": 4, "collective_timeout_s": 5, "max_restarts": 0},
        checkpoint={"every": 0, "export_hf": False},
        resources={"workers": 2},
    )
    stopped = job.pids()[1]
    while job.trainer.completed_steps < 1 and job.thread.is_alive():
        time.sleep(0.02)  # past the start, whose collectives keep the start's longer timeout
    os.kill(stopped, signal.SIGSTOP)
    try:
        job.wait(timeout_s=240)
        deadline = time.monotonic() + 30  # Ray's kill of the job's workers ends it a few seconds later
        while os.path.exists(f"/proc/{stopped}") and time.monotonic() < deadline:
            time.sleep(0.1)
        killed = not os.path.exists(f"/proc/{stopped}")
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(stopped, signal.SIGKILL)  # a stopped process never ends by itself
    assert isinstance(job.error, RestartsExhausted), job.error
    assert re.search(rf"rank 1, method '\w+': hung \(pid {stopped} on ", str(job.error)), str(job.error)
    assert "Timed out waiting 5000ms" in str(job.error)
    assert killed  # by the job's end, not by this test


class StopRollout(JsonlSink):
    """A real sink that SIGSTOPs the split placement's rollout worker once step 1 is recorded (its
    weights synced): step 2's generation never returns."""

    def __init__(self, folder) -> None:
        super().__init__(folder)
        self.trainer: Trainer | None = None
        self.stopped, self.at = 0, 0.0

    def metrics(self, step: int, values: dict) -> None:
        super().metrics(step, values)
        if step == 1:
            (self.stopped,) = recovery_worker_pids(self.trainer.job.groups)["rollout"]
            os.kill(self.stopped, signal.SIGSTOP)
            self.at = time.monotonic()


def test_a_rollout_worker_hung_in_generation_is_named_when_the_call_times_out(ray_cluster, tmp_path):
    """No collective waits for a split rollout worker: trainer.call_timeout_s ends the generation call,
    naming the worker (rank, pid, the call), and the loss is a lost worker's: with max_restarts 0 at once
    RestartsExhausted (the job's own error would have ended it unretried)."""
    split = {"placement": "split", "rollout": {"workers": 1}}
    spec = recovery_job(
        trainer={"total_steps": 3, "max_restarts": 0, "call_timeout_s": 5, "collective_timeout_s": 2},
        checkpoint={"every": 0, "export_hf": False},
        resources=split,
    )
    sink = StopRollout(tmp_path)
    trainer = sink.trainer = Trainer(JobSpec.model_validate(spec), tmp_path, sink, name="stoproll")
    try:
        with pytest.raises(RestartsExhausted) as exhausted:
            trainer.run()
        waited = time.monotonic() - sink.at
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(sink.stopped, signal.SIGKILL)  # a stopped process never ends by itself
    error = str(exhausted.value)
    named = rf"'stoproll-rollout', rank 0, method 'generate_sequences': did not answer within 5s \(pid {sink.stopped} on "
    assert re.search(named, error), error
    assert "trainer.call_timeout_s" in error and "more than trainer.max_restarts (0)" in error
    assert 5 <= waited < 30, waited  # bounded by the setting, not by the 3600 s of before
    assert [r["step"] for r in sink.history] == [1]


def test_what_is_retried_and_what_is_not():
    died = WorkerGroupError("job-actor", "update_actor", 1, "the worker actor died", kind="died")
    late = WorkerGroupError("job-actor", "generate_sequences", None, "did not answer", kind="timeout")
    hung = WorkerGroupError("job-actor", "update_actor", 1, "hung (pid 7 on 10.0.0.2)", kind="hung")
    raised = WorkerGroupError("job-actor", "update_actor", 0, "raised ValueError: nan loss")
    assert worker_lost(died, None).summary == "worker rank 1 died"
    assert worker_lost(late, None).summary == "a worker did not answer in time"
    assert worker_lost(hung, None).summary == "worker rank 1 hung"
    assert worker_lost(RayActorError(), None).cause == "died"
    assert worker_lost(ResourcePoolError("no room"), None).cause == "could not be placed"
    silent = TransferTimeout(
        "weight transfer timed out: rank 0 did not answer", "job-rollout", 0, "receive_weights"
    )
    assert worker_lost(silent, None).summary == "worker rank 0 stopped answering in a weight transfer"
    assert worker_lost(silent, None).group == "job-rollout"
    bad = TransferError("weight transfer failed: rank 0 raised ValueError: shape (7,)")
    for own in (raised, bad, ValueError("bad reward"), FileNotFoundError("no model"), KeyError("lr")):
        assert worker_lost(own, None) is None
    losses = [WorkerLost("died", "first"), WorkerLost("died", "second")]
    assert str(RestartsExhausted(losses, 1)).endswith("[attempt 1] first; [attempt 2] second")


def test_a_rewind_drops_the_undrained_metrics_after_the_checkpoint_and_tells_the_next_drain():
    from controller.job_actor import BufferSink

    sink = BufferSink()
    for step in (1, 2, 3):
        sink.metrics(step, {"x": float(step)})
    assert sink.drain()["rewind"] is None
    for step in (4, 5):
        sink.metrics(step, {"x": float(step)})
    sink.rewind(2)  # steps 3-5 are recomputed: 4 and 5 never reach the store, 3 is forgotten there
    sink.metrics(3, {"x": 30.0})
    drained = sink.drain()
    assert drained["rewind"] == 2 and [(s, v["x"]) for _, s, v in drained["metrics"]] == [(3, 30.0)]
    assert sink.drain()["rewind"] is None


@pytest.mark.slow
def test_a_dead_controller_requeues_the_job_and_it_resumes(live, api, uninterrupted):
    """The job's controller actor killed (its node lost, say): the scheduler puts the job back in
    queued, within the same restart budget, and a new controller resumes it from its checkpoint."""
    job = api.post("/v1/jobs", json=recovery_job()).json()
    wait_for_step(api, job["id"], 1)
    os.kill(ray.get(controller(live, job["id"]).pid.remote(), timeout=60), signal.SIGKILL)
    done = wait_for(api, job["id"], TERMINAL)
    assert done["status"] == "succeeded", done["error"]
    events = api.get(f"/v1/jobs/{job['id']}/events", params={"limit": 1000}).json()["data"]
    (restart,) = [e for e in events if e["kind"] == "restart"]
    assert restart["data"]["cause"] == "controller died" and restart["data"]["attempt"] == 2
    assert restart["message"].startswith("restarting (1/3): the job's controller died; it waits in queued")
    rows = api.get(f"/v1/jobs/{job['id']}/metrics", params={"limit": 100}).json()["data"]
    assert [r["step"] for r in rows] == list(range(1, TOTAL + 1))
    assert rows[-1]["values"]["job/restarts"] == 1.0
    weights = final_weights(done["outputs"]["workdir"])
    assert all(torch.equal(weights[k], uninterrupted[k]) for k in weights)
