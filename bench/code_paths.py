"""How many of the repository's files one RL step runs code in (docs/ARCHITECTURE.md, "Paths").

A default GRPO job (built-in arithmetic task, tiny-qwen2, rule reward, one on-policy update) runs
two steps on a local Ray. The second step is traced in the controller (every function call, all
threads, `sys.setprofile`); the worker side of the same step, which runs in Ray processes, is traced
by running the hybrid worker in this process on the next step's prompts: generate_sequences,
update_actor (advantages filled in) and sync_weights, the calls the trainer makes. A file counts
when a function defined in it is called; the two sets are printed, and their union is the count.

    PYTHONPATH=$PWD .venv/bin/python bench/code_paths.py          (from the checkout's root)
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path.cwd()  # the checkout measured: run from its root (another checkout gives "before" counts)
PACKAGES = ("api", "controller", "workers", "engines", "schema")


def traced(fn: Callable[[], Any]) -> tuple[Any, set[str]]:
    """`fn()` and the repository files whose functions it called (in every thread)."""
    files: set[str] = set()

    def profile(frame, event, arg):  # noqa: ANN001 -- the sys.setprofile signature
        if event == "call":
            name = frame.f_code.co_filename
            if name.startswith(str(ROOT)):
                rel = os.path.relpath(name, ROOT)
                if rel.split(os.sep)[0] in PACKAGES:
                    files.add(rel)

    threading.setprofile(profile)
    sys.setprofile(profile)
    try:
        return fn(), files
    finally:
        sys.setprofile(None)
        threading.setprofile(None)


def controller_side(spec: Any, workdir: Path) -> tuple[set[str], Any]:
    from controller.sink import JsonlSink
    from controller.trainer import Trainer

    trainer = Trainer(spec, workdir, JsonlSink(workdir), name="paths")
    original = Trainer.step
    seen: dict[str, set[str]] = {}

    def step(self: Trainer) -> dict[str, float]:
        if self.step_index < spec.trainer.total_steps:
            return original(self)
        metrics, seen["files"] = traced(lambda: original(self))
        seen["prompts"] = self.job.next_prompts(self.step_index + 1)
        return metrics

    Trainer.step = step  # type: ignore[method-assign]
    try:
        trainer.run()
    finally:
        Trainer.step = original  # type: ignore[method-assign]
    return seen["files"], seen["prompts"]


def worker_side(spec: Any, prompts: Any) -> set[str]:
    import torch

    from controller.job_setup import hybrid_config
    from controller.models import resolve_model_path
    from workers.actor_role import ActorRolloutRefWorker
    from workers.batch import Batch

    os.environ.update({"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29533"})
    worker = ActorRolloutRefWorker(hybrid_config(spec, resolve_model_path(spec.model)))

    def one_step() -> None:
        batch = worker.generate_sequences(prompts)
        tensors = batch.tensors.clone(recurse=False)
        tensors["advantages"] = torch.randn(tensors["response_mask"].shape) * tensors["response_mask"]
        worker.update_actor(
            Batch(tensors, batch.non_tensors, batch.meta), spec.algorithm.policy_loss_config(), {}
        )
        worker.sync_weights()

    traced(one_step)  # warm: first calls build caches that later steps do not
    return traced(one_step)[1]


def main() -> None:
    import ray

    from schema.job import JobSpec

    spec = JobSpec.model_validate(
        {
            "trainer": {"total_steps": 2, "prompts_per_step": 4, "val_every": 0},
            "rollout": {"n": 4, "max_new_tokens": 4},
            "checkpoint": {"every": 100},
        }
    )
    ray.init(num_cpus=2, include_dashboard=False, runtime_env={"env_vars": {"PYTHONPATH": str(ROOT)}})
    with tempfile.TemporaryDirectory() as tmp:
        os.environ.setdefault("TANDEM_HOME", str(Path(tmp) / "home"))
        controller, prompts = controller_side(spec, Path(tmp))
        ray.shutdown()
        workers = worker_side(spec, prompts)
    every = controller | workers
    print(json.dumps({"controller": sorted(controller), "worker": sorted(workers - controller)}, indent=1))
    print(
        json.dumps(
            {
                "rl_step_files": len(every),
                "controller": len(controller),
                "worker_only": len(workers - controller),
            }
        )
    )


if __name__ == "__main__":
    main()
