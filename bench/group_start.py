"""A job's worker groups started side by side against one after another (controller/job_setup.py).

`start_groups` launches every group of a job (a split job's rollout and training groups, an actor
and its critic) and waits for them together (`ready_all`); before, each group was started and
waited for in turn. This runs `start_groups` on a real local Ray for jobs of the built-in tiny-qwen2
(or `--model`), timing each start to every group being up, with the baseline measured in the same
run: the same code with each launch waited for at once (`RayWorkerGroup.launch` wrapped so that it
returns only when its group is up: the order before). Modes alternate round by round. One JSON
line per start and one summary per job shape; progress to stderr.

    .venv/bin/python bench/group_start.py [--rounds 3] [--model tiny-qwen2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import ray  # noqa: E402

from controller import job_setup  # noqa: E402
from engines.models.tiny_models import build_builtin_model  # noqa: E402
from schema.job import JobSpec  # noqa: E402

SHAPES = {
    "split": {"resources": {"placement": "split", "workers": 1, "cpus_per_worker": 1,
                            "rollout": {"workers": 1, "cpus_per_worker": 1}}},
    "actor+critic": {"algorithm": {"advantage": "gae"}, "resources": {"workers": 1, "cpus_per_worker": 2}},
    "colocated": {"resources": {"workers": 1, "cpus_per_worker": 2}},
}  # fmt: skip


def one_after_another(launch):
    """RayWorkerGroup.launch as it behaved before: the group is up before the next is asked for."""

    def launched_and_waited(*args, **kwargs):
        pending = launch(*args, **kwargs)
        pending.wait()
        return pending

    return launched_and_waited


def timed_start(spec: JobSpec, model_path: str, name: str, mode: str) -> float:
    launch = job_setup.RayWorkerGroup.launch
    if mode == "one_after_another":
        job_setup.RayWorkerGroup.launch = staticmethod(one_after_another(launch))
    try:
        started = time.perf_counter()
        groups = job_setup.start_groups(spec, model_path, name)
        seconds = time.perf_counter() - started
    finally:
        job_setup.RayWorkerGroup.launch = staticmethod(launch)
    groups.shutdown()
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--model", default="tiny-qwen2", help="a built-in model name")
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    args = parser.parse_args()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    model_path = str(build_builtin_model(args.model, Path(tempfile.mkdtemp(prefix="group-start-"))))
    repo = str(Path(__file__).resolve().parents[1])
    ray.init(num_cpus=4, include_dashboard=False, logging_level="error",
             runtime_env={"env_vars": {"PYTHONPATH": repo, "TOKENIZERS_PARALLELISM": "false"}})  # fmt: skip
    modes = ["side_by_side", "one_after_another"]
    for shape in args.shapes:
        spec = JobSpec.model_validate({"model": {"path": model_path}, **SHAPES[shape]})
        times: dict[str, list[float]] = {m: [] for m in modes}
        timed_start(spec, model_path, f"warm-{shape}", modes[0])  # first start: files into the page cache
        for round_index in range(args.rounds):
            for mode in modes if round_index % 2 == 0 else modes[::-1]:
                seconds = timed_start(spec, model_path, f"{shape}-{mode}-{round_index}", mode)
                times[mode].append(seconds)
                line = {"bench": "group_start", "shape": shape, "mode": mode, "round": round_index,
                        "seconds": round(seconds, 2), "load_avg_1m": os.getloadavg()[0]}  # fmt: skip
                print(json.dumps(line), flush=True)
                print(f"  {shape} {mode} round {round_index}: {seconds:.1f} s", file=sys.stderr, flush=True)
        medians = {m: statistics.median(v) for m, v in times.items()}
        summary = {"bench": "group_start", "shape": shape, "model": args.model, "rounds": args.rounds,
                   **{f"{m}_s_median": round(v, 2) for m, v in medians.items()},
                   "ratio_side_by_side_vs_one_after_another":
                       round(medians["side_by_side"] / medians["one_after_another"], 3),
                   "load_avg_1m": os.getloadavg()[0]}  # fmt: skip
        print(json.dumps(summary), flush=True)
    ray.shutdown()


if __name__ == "__main__":
    main()
