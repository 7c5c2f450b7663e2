"""Default sizes fit: every role's CPU share comes from one budget that all of a job's workers divide.

Unit tests of role_shares (controller/resource_pool.py) on 2, 4 and 16 CPUs for colocated, split and
the async layout of docs/guides/multi-turn.md; then that async example and `{placement: split}` alone, sizes
left to the defaults, run to `succeeded` on a `tandem serve` whose own Ray has exactly 2 CPUs.
"""

from __future__ import annotations

import re
import secrets
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from controller.resource_pool import Capacity, Share, role_shares
from schema.resources import ResourcesSpec
from tests.api_util import tiny_job, wait_for
from tests.serve_util import Served, cluster_env, kill_leftovers, start_serve, stop

REPO = Path(__file__).resolve().parents[1]
GUIDE = REPO / "docs" / "guides" / "multi-turn.md"
COLOCATED = {}
SPLIT = {"placement": "split"}
ASYNC = {"placement": "split", "workers": 1, "rollout": {"workers": 3}}  # the guide's, checked below
NO_GPUS = 0.0


def shares(resources: dict, cpus: float, gpus: float = NO_GPUS) -> dict[str, Share]:
    return role_shares(ResourcesSpec.model_validate(resources), Capacity(cpus, gpus))


@pytest.mark.parametrize(
    ("resources", "cpus", "expected"),
    [
        (COLOCATED, 2, {"training": Share(1, 2.0, 0.0)}),
        (COLOCATED, 4, {"training": Share(1, 4.0, 0.0)}),
        (COLOCATED, 16, {"training": Share(1, 16.0, 0.0)}),
        ({"workers": 4}, 2, {"training": Share(4, 0.5, 0.0)}),
        ({"workers": 4}, 16, {"training": Share(4, 4.0, 0.0)}),
        (SPLIT, 2, {"training": Share(1, 1.0, 0.0), "rollout": Share(1, 1.0, 0.0)}),
        (SPLIT, 4, {"training": Share(1, 2.0, 0.0), "rollout": Share(1, 2.0, 0.0)}),
        (SPLIT, 16, {"training": Share(1, 8.0, 0.0), "rollout": Share(1, 8.0, 0.0)}),
        (ASYNC, 2, {"training": Share(1, 0.5, 0.0), "rollout": Share(3, 0.5, 0.0)}),
        (ASYNC, 4, {"training": Share(1, 1.0, 0.0), "rollout": Share(3, 1.0, 0.0)}),
        (ASYNC, 16, {"training": Share(1, 4.0, 0.0), "rollout": Share(3, 4.0, 0.0)}),
        ({"workers": 2, "placement": "split", "rollout": {"workers": 1}}, 2,
         {"training": Share(2, 0.66, 0.0), "rollout": Share(1, 0.66, 0.0)}),
    ],
)  # fmt: skip
def test_default_shares_divide_the_cpus_among_every_worker(resources, cpus, expected):
    assert shares(resources, cpus) == expected


def test_every_job_of_defaults_fits_its_budget_up_to_four_workers_a_core():
    for cpus in (1, 2, 3, 4, 7, 16, 64):
        for training in range(1, 9):
            layouts = [{"workers": training}] + [
                {"workers": training, "placement": "split", "rollout": {"workers": r}} for r in range(1, 9)
            ]
            for layout in layouts:
                held = shares(layout, cpus).values()
                workers = sum(s.workers for s in held)
                if workers <= 4 * cpus:
                    assert 0 < sum(s.workers * s.cpus for s in held) <= cpus + 1e-9, (layout, cpus)
                else:  # more than four processes a core: a quarter CPU each, which the cluster refuses
                    assert {s.cpus for s in held} == {0.25}, (layout, cpus)


def test_explicit_sizes_are_kept_and_the_defaults_divide_what_they_leave():
    mixed = {"placement": "split", "workers": 1, "cpus_per_worker": 1, "rollout": {"workers": 3}}
    assert shares(mixed, 4) == {"training": Share(1, 1.0, 0.0), "rollout": Share(3, 1.0, 0.0)}
    assert shares(mixed, 2)["rollout"] == Share(3, 0.33, 0.0)
    # An explicit size that takes the whole budget: the defaults get an even split of it, and the
    # job holds more than the node (the service refuses it, naming resources).
    greedy = {"placement": "split", "workers": 1, "cpus_per_worker": 2, "rollout": {"workers": 1}}
    assert shares(greedy, 2) == {"training": Share(1, 2.0, 0.0), "rollout": Share(1, 1.0, 0.0)}
    assert shares({"cpus_per_worker": 6}, 2) == {"training": Share(1, 6.0, 0.0)}


def test_gpus_default_to_one_per_worker_when_the_cluster_has_gpus():
    assert shares(ASYNC, 16, gpus=4.0) == {"training": Share(1, 4.0, 1.0), "rollout": Share(3, 4.0, 1.0)}
    assert shares(ASYNC, 16, gpus=0.0)["rollout"].gpus == 0.0
    explicit = {**ASYNC, "gpus_per_worker": 0.5, "rollout": {"workers": 3, "gpus_per_worker": 0.25}}
    assert {r: s.gpus for r, s in shares(explicit, 16, gpus=1.0).items()} == {
        "training": 0.5,
        "rollout": 0.25,
    }


def test_the_guides_async_example_is_the_layout_tested_here():
    block = re.search(r"```yaml\n(resources: .*?)```", GUIDE.read_text(), re.S).group(1)
    example = yaml.safe_load(block)
    assert example == {"resources": ASYNC, "trainer": {"mode": "async"}}


# ---- on a default service with 2 CPUs -----------------------------------------------------------------


@pytest.fixture(scope="module")
def two_cpus() -> Iterator[Served]:
    """`tandem serve` with defaults and its own local Ray of exactly 2 CPUs, on a fresh home."""
    tmp = tempfile.mkdtemp(prefix="tdr-", dir="/tmp")  # short: Ray's socket paths have a length limit
    served = None
    try:
        served = start_serve(Path(tmp), cluster_env(tmp), "tdm_" + secrets.token_urlsafe(24), "serve", 2)
        yield served
    finally:
        if served is not None:
            stop(served.process, 60)
        kill_leftovers(tmp)
        shutil.rmtree(tmp, ignore_errors=True)


def guess_number_job(**overrides) -> dict:
    """A one-step multi-turn job on the built-in chat model and game (the guide's kind of job); the
    game's reward is the score."""
    spec = tiny_job(
        model={"builtin": "tiny-qwen2-chat"},
        data={"builtin_task": "guess_number"},
        rollout={"environment": "builtin:guess_number", "n": 2, "max_new_tokens": 6, "max_turns": 3,
                 "max_response_tokens": 48},
        trainer={"total_steps": 1, "prompts_per_step": 2, "val_every": 0},
        checkpoint={"every": 0, "export_hf": False},
        metadata={"suite": "default-resources"},
        **overrides,
    )  # fmt: skip
    del spec["reward"]
    return spec


@pytest.mark.parametrize(
    ("name", "resources", "trainer"),
    # the split layout's default shares run in make test-slow; a split job runs in make test
    # (tests/test_placement.py), and this 2-CPU service runs the async example's shares
    [("async example", ASYNC, {"mode": "async"}), pytest.param("split", SPLIT, {}, marks=pytest.mark.slow)],
)
def test_a_job_of_default_sizes_runs_on_a_two_cpu_service(two_cpus, name, resources, trainer):
    with two_cpus.client() as client:
        cluster = client.get("/v1/cluster").json()
        assert cluster["cpus"]["total"] == 2, cluster
        spec = guess_number_job(resources=resources)
        spec["trainer"] = {**spec["trainer"], **trainer}
        checked = client.post("/v1/jobs/validate", json=spec)
        assert checked.status_code == 200, checked.text
        made = client.post("/v1/jobs", json=spec)
        assert made.status_code == 201, made.text
        job = wait_for(client, made.json()["id"], ("succeeded", "failed", "cancelled"), timeout_s=400)
        assert job["status"] == "succeeded", (name, job, two_cpus.log_tail())
        assert job["step"] == 1
