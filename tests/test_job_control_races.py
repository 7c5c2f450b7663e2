"""Job control requests sent at once, as an impatient owner sends them: each answer names the status the
job has when it is answered, and a request the job's status already satisfies is not refused."""

from __future__ import annotations

import json
import shutil
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import ray

from tests.api_util import tiny_job, wait_for


@pytest.fixture(scope="module")
def held(unscheduled, ray_cluster) -> Iterator[httpx.Client]:
    """An admin client of a service that starts no job: a job stays queued until it is steered."""
    with unscheduled.client() as client:
        yield client


def at_once(api: httpx.Client, path: str, times: int = 50) -> list[httpx.Response]:
    with ThreadPoolExecutor(16) as pool:
        return list(pool.map(lambda _: api.post(path), range(times)))


def queued_job(api: httpx.Client) -> str:
    return api.post("/v1/jobs", json=tiny_job(metadata={"suite": "races"})).json()["id"]


def test_fifty_resumes_or_cancels_at_once_name_the_status_they_found(held):
    for action, after in (("resume", "queued"), ("cancel", "cancelled")):
        job_id = queued_job(held)
        held.post(f"/v1/jobs/{job_id}/pause")
        answers = at_once(held, f"/v1/jobs/{job_id}/{action}")
        assert sorted(a.status_code for a in answers) == [200] + [409] * 49
        for refused in (a for a in answers if a.status_code == 409):
            assert refused.json()["error"]["message"].startswith(f"job '{job_id}' is {after}:"), refused.text
        assert wait_for(held, job_id, (after,))["status"] == after


def test_a_hyperparameter_edit_between_the_schedulers_read_and_the_start_reaches_the_run(unscheduled, held):
    """The scheduler's loop reads the queued jobs, then starts one: an edit accepted in between (its
    message finds no controller yet) must be in the spec the run starts with."""
    scheduler = unscheduled.service.scheduler
    job_id = queued_job(held)
    read = next(j for j in unscheduled.service.store.jobs_in(("queued",)) if j.id == job_id)
    assert held.patch(f"/v1/jobs/{job_id}/hyperparameters", json={"lr": 5e-4}).status_code == 200
    assert scheduler._try_start(read, scheduler.owner_usage()) == "started"
    try:
        actor = scheduler.controller(job_id)
        lr = ray.get(actor.__ray_call__.remote(lambda a: a.runner.trainer.spec.optim.lr), timeout=180)
    finally:
        assert held.post(f"/v1/jobs/{job_id}/cancel").status_code == 200
        deadline = time.time() + 120
        while scheduler.controller(job_id) is not None and time.time() < deadline:
            scheduler._collect()  # this service has no scheduler loop: settle the cancelled run here
            time.sleep(0.2)
    assert lr == 5e-4
    assert held.get(f"/v1/jobs/{job_id}").json()["status"] == "cancelled"


def test_a_fork_whose_checkpoint_goes_while_it_is_copied_is_409_and_leaves_no_partial_copy(unscheduled, held):
    """The parent prunes its checkpoint (or is deleted) while a fork copies it: the fork is told to pick a
    newer one, and no half copy stays under fork-sources/."""
    job_id = queued_job(held)
    held.post(f"/v1/jobs/{job_id}/pause")
    folder = Path(wait_for(held, job_id, ("paused",))["outputs"]["workdir"]) / "checkpoints" / "step_2"
    folder.mkdir(parents=True)
    (folder / "trainer_state.json").write_text(json.dumps({"step": 2}))
    for i in range(4000):  # enough files that the copy is under way when the folder goes
        (folder / f"shard_{i}").write_text("w")
    unscheduled.service.store.add_checkpoint(job_id, 2, str(folder))
    sources = unscheduled.service.jobs_root / "fork-sources"
    sources.mkdir(exist_ok=True)
    before = sorted(sources.iterdir())

    def prune_once_the_copy_began() -> None:
        deadline = time.time() + 60
        while sorted(sources.iterdir()) == before and time.time() < deadline:
            time.sleep(0.001)
        shutil.rmtree(folder)

    pruner = threading.Thread(target=prune_once_the_copy_began)
    pruner.start()
    fork = held.post(f"/v1/jobs/{job_id}/fork", json={"overrides": {"trainer": {"total_steps": 9}}})
    pruner.join()
    assert fork.status_code == 409, fork.text
    assert fork.json()["error"]["code"] == "checkpoint_pruned"
    assert sorted(sources.iterdir()) == before
