"""Job control requests sent at once, as an impatient owner sends them: each answer names the status the
job has when it is answered, and a request the job's status already satisfies is not refused."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

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
