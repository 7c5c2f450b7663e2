"""Warm controllers (service/controller_pool.py): a job's controller actor is started and has imported
its runner before the job is submitted; it serves that one job, and another warms up."""

from __future__ import annotations

import time

import pytest
import ray

from service.workloads import WorkloadActor
from tests.api_util import tiny_job, wait_for


def test_a_job_runs_in_the_controller_that_warmed_up_for_it_and_another_warms_up(live, api):
    pool = live.service.scheduler.controllers
    (spare,) = pool.spares()
    spare_pid = ray.get(spare.pid.remote(), timeout=180)  # it answers once its runner's module is imported
    job = api.post("/v1/jobs", json=tiny_job(trainer={"total_steps": 1})).json()
    deadline = time.monotonic() + 60
    while (actor := live.service.scheduler.controller(job["id"])) is None:
        assert time.monotonic() < deadline, "the job was not launched within 60 s"
        time.sleep(0.05)
    assert ray.get(actor.pid.remote(), timeout=60) == spare_pid
    (next_spare,) = pool.spares()  # taken from the pool, and another started in its place
    assert ray.get(next_spare.pid.remote(), timeout=180) != spare_pid
    done = wait_for(api, job["id"], ("succeeded", "failed"), 300)
    assert done["status"] == "succeeded", done
    # It served one job and ended with it: its process is gone, the next job gets the new spare.
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(actor.pid.remote(), timeout=60)
    assert pool.spares() == [next_spare]


def test_a_controller_serves_one_record_and_says_why_its_runner_failed_to_build(ray_cluster, tmp_path):
    actor = (
        ray.remote(WorkloadActor)
        .options(num_cpus=0, max_concurrency=4)
        .remote("controller.job_actor:JobController")
    )
    try:
        run = actor.run.remote()  # sent before begin: it waits for the runner
        bad = tiny_job(trainer={"total_steps": 0})  # the job's spec refuses it
        with pytest.raises(ray.exceptions.RayTaskError, match="total_steps"):
            ray.get(actor.begin.remote("job-a", bad, str(tmp_path / "a")), timeout=180)
        with pytest.raises(ray.exceptions.RayTaskError, match="failed to build: ValidationError"):
            ray.get(run, timeout=60)
        assert ray.get(actor.worker_pids.remote(), timeout=60) == {}
        with pytest.raises(ray.exceptions.RayTaskError, match="already serves a record"):
            ray.get(actor.begin.remote("job-b", tiny_job(), str(tmp_path / "b")), timeout=60)
    finally:
        ray.kill(actor, no_restart=True)
