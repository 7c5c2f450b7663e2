"""Job lifecycle edges against a live service: forks that are refused, DELETE, a cancel during start-up.

Forks here start from a checkpoint folder written into a job that never ran (its trainer_state.json
is what makes a folder a checkpoint), so no training is needed to test what the service refuses.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import ray

from tests.api_util import TERMINAL, tiny_job, wait_for


@pytest.fixture(scope="module")
def held(unscheduled, ray_cluster) -> Iterator[httpx.Client]:
    """An admin client of a service that starts no job (a fork is checked against Ray's cluster)."""
    with unscheduled.client() as client:
        yield client


def paused_job(api: httpx.Client, suite: str) -> dict:
    """Paused before it ran (on `held`'s service nothing runs)."""
    job = api.post("/v1/jobs", json=tiny_job(trainer={"total_steps": 1000}, metadata={"suite": suite})).json()
    api.post(f"/v1/jobs/{job['id']}/pause")
    return wait_for(api, job["id"], ("paused",))


def fake_checkpoint(live, job: dict, step: int) -> Path:
    folder = Path(job["outputs"]["workdir"]) / "checkpoints" / f"step_{step}"
    folder.mkdir(parents=True)
    (folder / "trainer_state.json").write_text(json.dumps({"step": step}))
    live.service.store.add_checkpoint(job["id"], step, str(folder))
    return folder


def fork_sources(live) -> list[Path]:
    root = live.service.jobs_root / "fork-sources"
    return sorted(root.iterdir()) if root.exists() else []


def test_a_fork_with_no_steps_left_is_422_and_refused_forks_leave_no_copy(unscheduled, held):
    live, api = unscheduled, held
    parent = paused_job(api, "fork-edges")
    fake_checkpoint(live, parent, 5)
    before = fork_sources(live)
    for total in (5, 3):
        short = api.post(  # nothing to train after step 5
            f"/v1/jobs/{parent['id']}/fork", json={"overrides": {"trainer": {"total_steps": total}}}
        )
        assert short.status_code == 422, short.text
        assert short.json()["error"]["param"] == "trainer.total_steps"
    too_big = api.post(
        f"/v1/jobs/{parent['id']}/fork",
        json={"overrides": {"trainer": {"total_steps": 9}, "resources": {"cpus_per_worker": 64}}},
    )
    assert too_big.status_code == 422 and too_big.json()["error"]["code"] == "insufficient_resources"
    assert fork_sources(live) == before  # neither refusal left a copied checkpoint behind

    child = api.post(f"/v1/jobs/{parent['id']}/fork", json={"overrides": {"trainer": {"total_steps": 9}}})
    assert child.status_code == 201, child.text
    copy = Path(child.json()["spec"]["checkpoint"]["resume_from"])
    assert copy.parent in fork_sources(live) and (copy / "trainer_state.json").exists()
    api.post(f"/v1/jobs/{child.json()['id']}/cancel")  # (had it started, the fake checkpoint fails it)
    wait_for(api, child.json()["id"], TERMINAL)
    assert api.delete(f"/v1/jobs/{child.json()['id']}").status_code == 200
    assert not copy.parent.exists()  # a deleted fork takes its private checkpoint copy with it
    api.post(f"/v1/jobs/{parent['id']}/cancel")


def test_delete_removes_the_job_folder(unscheduled, held):
    live, api = unscheduled, held
    job = paused_job(api, "delete-folder")
    folder = fake_checkpoint(live, job, 2).parents[1]
    assert api.delete(f"/v1/jobs/{job['id']}").status_code == 409  # paused: cancel first
    api.post(f"/v1/jobs/{job['id']}/cancel")
    assert api.delete(f"/v1/jobs/{job['id']}").json()["deleted"] is True
    assert not folder.exists()
    assert api.get(f"/v1/jobs/{job['id']}").status_code == 404


def test_a_cancel_during_start_up_does_not_wait_for_the_first_step(live, api):
    job = api.post("/v1/jobs", json=tiny_job(trainer={"total_steps": 50}, metadata={"suite": "cancel-early"}))
    job_id = job.json()["id"]
    wait_for(api, job_id, ("running",), timeout_s=120)
    assert api.post(f"/v1/jobs/{job_id}/cancel").json()["status"] in ("cancelling", "cancelled")
    done = wait_for(api, job_id, ("cancelled", "failed", "succeeded"), timeout_s=60)
    assert done["status"] == "cancelled" and done["step"] == 0
    events = api.get(f"/v1/jobs/{job_id}/events", params={"limit": 1000}).json()["data"]
    assert events[-1]["kind"] == "cancelled" and "starting up" in events[-1]["message"]
    pools = [p for p in ray.util.placement_group_table().values() if p["name"] == f"{job_id}-pool"]
    assert all(p["state"] == "REMOVED" for p in pools)  # nothing of the job holds the cluster
