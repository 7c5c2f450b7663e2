"""Warm controllers (service/controller_pool.py): a job's controller actor is started and has imported
its runner before the job is submitted; it serves that one job, and another warms up."""

from __future__ import annotations

import time

import pytest
import ray
from pydantic import ValidationError

from api.settings import ServeSettings
from service.workloads import WorkloadActor
from tests.api_util import start_service, tiny_job, wait_for, wait_for_step


@pytest.fixture(scope="module")
def warm(ray_cluster, tmp_path_factory):
    """A real service that keeps one warm controller (the suite's others keep none: conftest.py)."""
    service = start_service(tmp_path_factory.mktemp("warm"), settings=ServeSettings(warm_controllers=1))
    yield service
    service.stop()


def test_a_job_runs_in_the_controller_that_warmed_up_for_it_and_the_next_warms_up_after_its_start(warm):
    pool = warm.service.scheduler.controllers
    (spare,) = pool.spares()
    spare_pid = ray.get(spare.pid.remote(), timeout=180)  # it answers once its runner's module is imported
    with warm.client() as api:
        job = api.post("/v1/jobs", json=tiny_job(trainer={"total_steps": 2})).json()
        deadline = time.monotonic() + 60
        while (actor := warm.service.scheduler.controller(job["id"])) is None:
            assert time.monotonic() < deadline, "the job was not launched within 60 s"
            time.sleep(0.05)
        assert ray.get(actor.pid.remote(), timeout=60) == spare_pid
        # Taken from the pool; the next one starts only once the job is past its start-up.
        assert pool.spares() == []
        wait_for_step(api, job["id"], 1)
        deadline = time.monotonic() + 30
        while not pool.spares():
            assert time.monotonic() < deadline, "no controller warmed up after the job's first step"
            time.sleep(0.1)
        (next_spare,) = pool.spares()
        assert ray.get(next_spare.pid.remote(), timeout=180) != spare_pid
        done = wait_for(api, job["id"], ("succeeded", "failed"), 300)
        assert done["status"] == "succeeded", done
    # It served one job and ended with it: its process is gone, the next job gets the new spare.
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(actor.pid.remote(), timeout=60)
    assert pool.spares() == [next_spare]


def test_the_suites_services_keep_none_and_serve_reads_the_setting_from_the_environment(live, monkeypatch):
    assert live.service.scheduler.controllers.spares() == []  # TANDEM_WARM_CONTROLLERS=0 (conftest.py)
    monkeypatch.setenv("TANDEM_WARM_CONTROLLERS", "3")
    assert ServeSettings().warm_controllers == 3
    monkeypatch.setenv("TANDEM_WARM_CONTROLLERS", "many")
    with pytest.raises(ValidationError, match="warm_controllers"):
        ServeSettings()
    monkeypatch.delenv("TANDEM_WARM_CONTROLLERS")
    assert ServeSettings().warm_controllers == 1  # the service's own default


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
