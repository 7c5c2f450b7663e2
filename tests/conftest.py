"""Shared fixtures: a real local Ray cluster started by the tests, and tiny HF models built locally."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# The suite's services (in this process and `tandem serve` children) keep no warm job controller
# (service/controller_pool.py): most start, run 0-3 jobs and stop, so each spare would be ~7 s of a
# core spent importing for nothing, on a suite that is CPU-bound on 2 cores. Every job still starts
# through `WorkloadActor.begin`; tests/test_warm_controllers.py runs a service that keeps one.
os.environ.setdefault("TANDEM_WARM_CONTROLLERS", "0")


@pytest.fixture(scope="session")
def ray_cluster():
    """A local Ray with 8 logical CPUs (the 2 real cores are time-shared), started once per session."""
    import ray

    from api.server import ray_init

    if not ray.is_initialized():
        ray_init(
            num_cpus=8,
            num_gpus=0,
            include_dashboard=False,
            namespace="tandem-tests",
            runtime_env={"env_vars": {"PYTHONPATH": str(REPO), "TOKENIZERS_PARALLELISM": "false"}},
            logging_level="warning",
        )
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """The tiny-qwen2 model (87k parameters), built once per session in HF format."""
    from engines.models.tiny_models import build_builtin_model

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    return build_builtin_model("tiny-qwen2", tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="module")
def live(ray_cluster, tmp_path_factory):
    """A real service for the module: the Service on the tests' Ray, uvicorn on 127.0.0.1, SQLite."""
    from tests.api_util import start_service

    monkey = pytest.MonkeyPatch()
    monkey.setenv("TANDEM_HOME", str(tmp_path_factory.getbasetemp() / "home"))
    svc = start_service(tmp_path_factory.mktemp("service"))
    yield svc
    svc.stop()
    monkey.undo()


@pytest.fixture(scope="module")
def api(live):
    """An HTTP client of `live` carrying the admin token."""
    with live.client() as client:
        yield client


@pytest.fixture(scope="module")
def unscheduled(tmp_path_factory):
    """A real service without its scheduler, for the module: no Ray, jobs stay queued (reads, auth)."""
    from tests.api_util import start_service

    svc = start_service(tmp_path_factory.mktemp("unscheduled"), schedule=False)
    yield svc
    svc.stop()


# `make test` runs two pytest processes, each taking a whole module at a time (--dist loadscope
# --no-loadscope-reorder): the modules that run for minutes are handed out first, so that the run
# does not end with one process on a long module while the other has nothing left to take. A module
# missing here only runs later; the order of a module's own tests is kept.
LONG_MODULES = (
    "test_docs_run.py",
    "test_async_rl.py",
    "test_serve_crash.py",
    "test_external_async.py",
    "test_samples_api.py",
    "test_cli.py",
    "test_verifiers.py",
    "test_trainer.py",
    "test_api.py",
    "test_placement.py",
    "test_recovery.py",
    "test_openai_responses.py",
    "test_walkthrough.py",
    "test_rollout_vllm.py",
    "test_default_resources.py",
    "test_demo_signals.py",
    "test_multinode.py",
    "test_service_process.py",
    "test_openenv_job.py",
    "test_rollout_replacement.py",
    "test_reasoning_gym.py",
    "test_openai_bounds.py",
    "test_worker_group.py",
    "test_lora_split.py",
    "test_openai_endpoint.py",
    "test_offline_bundle.py",
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(LONG_MODULES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))
