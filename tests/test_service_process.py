"""The API process of a real `tandem serve` stays free of the training stack.

The service (store, scheduler, requests) imports no torch, transformers or worker class: a job's
runner is imported in the job's own Ray actor (service/workloads.py). Checked through the real
process's own `sys.modules` (`GET /v1/service`) after it started, validated and ran a job.
"""

from __future__ import annotations

import secrets

from tests.api_util import tiny_job, wait_for
from tests.serve_util import stop
from tests.test_serve_crash import crash_dir, start_serve  # noqa: F401  (crash_dir is a fixture)

HEAVY = ("torch", "transformers", "tensordict", "workers.actor_role", "controller.job_actor")


def test_the_api_process_never_imports_torch(crash_dir):  # noqa: F811
    root, env = crash_dir
    served = start_serve(root, env, "tdm_" + secrets.token_hex(16), "serve")
    try:
        with served.client() as api:
            assert {m: api.get("/v1/service").json()["modules"][m] for m in HEAVY} == dict.fromkeys(
                HEAVY, False
            )
            spec = tiny_job(trainer={"total_steps": 1})
            assert api.post("/v1/jobs/validate", json=spec).status_code == 200
            job = api.post("/v1/jobs", json=spec).json()
            assert wait_for(api, job["id"], ("succeeded", "failed"))["status"] == "succeeded"
            assert api.get(f"/v1/jobs/{job['id']}/metrics").json()["data"], "the job recorded no step"
            info = api.get("/v1/service").json()
            assert {m: info["modules"][m] for m in HEAVY} == dict.fromkeys(HEAVY, False)
            assert info["rss_bytes"] > 0
            assert api.get("/v1/version").json()["torch"].startswith("2.")  # from package metadata
    finally:
        stop(served.process, 60)
