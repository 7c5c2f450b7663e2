"""rollout.external.agent: a job that runs an `openai`-SDK agent function itself, in worker processes,
and trains on its trajectories (controller/external_agents.py)."""

from __future__ import annotations

import os
import signal
import time

import pytest

from tests.api_util import TERMINAL, tiny_job, wait_for, wait_for_step

pytestmark = pytest.mark.usefixtures("ray_cluster")


def agent_job(agent: str) -> dict:
    return tiny_job(
        model={"builtin": "tiny-qwen2-chat"},
        rollout={"source": "external", "free_cache_after_generate": False,
                 "external": {"group_size": 2, "trajectories_per_step": 4, "agent": agent, "agent_workers": 2}},
        trainer={"total_steps": 1, "val_every": 0, "samples_per_step": 2},
        checkpoint={"every": 0},
    )  # fmt: skip


def test_an_agent_worker_whose_sandbox_ended_starts_a_fresh_one():
    """A call that ends the agent's process (a limit, an exit) fails that trajectory only: the worker's
    later calls run in a new sandbox instead of failing at once for the rest of the job."""
    import ray

    from controller.external_agents import AgentWorker

    worker = (
        ray.remote(AgentWorker).options(num_cpus=0).remote("tests.agent_fns:exits_on_task_zero", None, "m")
    )
    try:
        with pytest.raises(Exception, match="exit code 3"):
            ray.get(worker.run.remote(0, "agent-0"), timeout=120)
        assert ray.get(worker.run.remote(1, "agent-1"), timeout=120) == {"reward": 1.0}
    finally:
        ray.kill(worker)


def agent_pids(state) -> list[int]:
    """The pids of the live AgentWorker actors (Ray's state API)."""
    actors = state.actors().values()
    return [
        a["Pid"]
        for a in actors
        if a["ActorClassName"] == "AgentWorker" and a["State"] == "ALIVE" and a["Pid"]
    ]


def test_an_agent_worker_whose_process_died_is_replaced_not_called_again(tmp_path):
    """A dead AgentWorker actor (its process killed) answers every call at once with an error: reused,
    it would spin the agents' loop through failures for the rest of the job."""
    import ray
    from ray._private import state

    from controller.external import ExternalServer
    from controller.external_agents import AgentPool
    from engines.models.tiny_models import build_builtin_model
    from schema.external import ExternalSpec

    model = str(build_builtin_model("tiny-qwen2-chat", tmp_path))
    config = ExternalSpec(agent="tests.agent_fns:paced_agent", agent_workers=1, group_size=1,
                          trajectories_per_step=1)  # fmt: skip
    server = ray.remote(ExternalServer).remote("agent-test", model, config)
    pool = AgentPool(config, server, model)
    try:
        deadline = time.monotonic() + 120  # generous: under load a worker's process takes seconds to start
        while len(pids := agent_pids(state)) != 1:  # the pool's one worker (an earlier job's are gone)
            assert time.monotonic() < deadline, f"agent workers alive: {pids}"
            time.sleep(0.2)
        os.kill(pids[0], signal.SIGKILL)
        killed_at, failed_before = time.monotonic(), pool.failed
        while not (fresh := [p for p in agent_pids(state) if p != pids[0]]):
            assert time.monotonic() < deadline, f"the dead worker was not replaced: {pool.stats()}"
            time.sleep(0.2)
        started = pool.started
        while pool.started < started + 2:  # the new worker runs calls
            assert time.monotonic() < deadline, f"worker {fresh[0]} runs no calls: {pool.stats()}"
            time.sleep(0.1)
        # paced_agent fails at most ~5 calls a second on a live worker; a dead one, reused, fails
        # thousands a second (every call on it answers at once)
        elapsed = time.monotonic() - killed_at
        assert pool.failed - failed_before <= 10 * elapsed + 5, (elapsed, pool.stats())
    finally:
        pool.stop()
        ray.kill(server)


# slow (make test-slow): the endpoint itself is in make test (tests/test_openai_endpoint.py); this runs
# the user agent inside the job
@pytest.mark.slow
def test_a_job_trains_on_the_agent_it_runs(api):
    job = api.post("/v1/jobs", json=agent_job("tests.agent_fns:digits_agent")).json()["id"]
    final = wait_for(api, job, TERMINAL, timeout_s=240)
    assert final["status"] == "succeeded", final
    rows = api.get(f"/v1/jobs/{job}/metrics", params={"keys": "external/*,critic/score/mean"}).json()["data"]
    last = rows[-1]["values"]
    assert last["external/agent_calls_done"] >= 4 and last["external/agent_failures"] == 0
    assert 0.0 <= last["critic/score/mean"] <= 1.0
    sample = api.get(f"/v1/jobs/{job}/samples", params={"step": 1}).json()["data"][0]
    assert sample["trajectory"]["id"].startswith("agent-") and sample["uid"].startswith("t")


def test_an_agents_reward_the_api_would_refuse_is_refused_and_the_job_trains_on(api):
    """A NaN reward or a task id that is not text, from an agent the job runs, is refused as the API
    refuses it (it would poison the step or stop the agents' loop), and counted as a failure."""
    job = api.post("/v1/jobs", json=agent_job("tests.agent_fns:unruly_agent")).json()["id"]
    final = wait_for(api, job, TERMINAL, timeout_s=240)
    assert final["status"] == "succeeded", final
    rows = api.get(f"/v1/jobs/{job}/metrics", params={"keys": "external/*,critic/score/mean"}).json()["data"]
    last = rows[-1]["values"]
    # tasks 0 and 1 (four runs) never train; two workers run them first, one run at a time each, so
    # by the step that trained on tasks 2 and 3 at most one of the four is still running
    assert last["external/agent_failures"] >= 3
    assert 0.0 <= last["critic/score/mean"] <= 1.0  # NaN fails this


@pytest.mark.parametrize("agent", ["tests.agent_fns:not_a_function", "os:system", "json:dumps"])
def test_an_agent_that_is_not_an_agent_function_is_refused_at_submission(api, agent):
    before = len(api.get("/v1/jobs").json()["data"])
    refused = api.post("/v1/jobs", json=agent_job(agent))
    assert refused.status_code == 422, refused.text
    assert refused.json()["error"]["param"] == "rollout.external.agent"
    assert len(api.get("/v1/jobs").json()["data"]) == before


@pytest.mark.slow  # the soak (bench/soak.py) kills such jobs' workers too
def test_an_agent_job_whose_worker_dies_restarts_and_succeeds(live, api):
    """A lost worker of an agent job is retried like any job's. (When the death surfaces first in the
    endpoint actor, as a RayTaskError, controller/recovery.py still calls it a lost worker; that
    timing is the soak's to hit, bench/soak.py --kinds training.)"""
    from tests.test_recovery import worker_pids

    spec = agent_job("tests.agent_fns:digits_agent")
    spec["trainer"].update(total_steps=3, max_restarts=2, restart_backoff_s=0)
    spec["checkpoint"] = {"every": 1}
    job = api.post("/v1/jobs", json=spec).json()["id"]
    pids = worker_pids(live, job)
    wait_for_step(api, job, 1, timeout_s=240)
    os.kill(pids[0], signal.SIGKILL)
    final = wait_for(api, job, TERMINAL, timeout_s=300)
    assert final["status"] == "succeeded", final["error"]
    assert final["latest_metrics"]["job/restarts"] >= 1.0
