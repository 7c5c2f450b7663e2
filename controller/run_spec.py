"""Run one job spec to the end in this process, without the service: `python -m controller.run_spec`.

The entrypoint of a KubeRay RayJob (deploy/k8s/rayjob/): started again on the same folder, the job
resumes from its last complete checkpoint, so a retried RayJob carries on where the failed one stopped.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path

import yaml

from schema.job import JobSpec


def load_spec(path: str | Path) -> JobSpec:
    """A JobSpec from a YAML or JSON file (pydantic's error names a bad field)."""
    text = Path(path).read_text()
    data = json.loads(text) if str(path).endswith(".json") else yaml.safe_load(text)
    if not isinstance(data, dict):
        raise ValueError(f"job spec {path} must be a mapping of sections, got {type(data).__name__}")
    return JobSpec.model_validate(data)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m controller.run_spec", description=__doc__.splitlines()[0]
    )
    parser.add_argument("spec", help="job spec file (YAML or JSON)")
    parser.add_argument("--workdir", required=True, help="the job's folder: checkpoints, export, logs")
    parser.add_argument(
        "--name", default=None, help="job name for worker groups (default: the folder's name)"
    )
    parser.add_argument(
        "--ray-address", default=None, help="Ray cluster to join (default: RAY_ADDRESS, else a local Ray)"
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    spec = load_spec(args.spec)  # before Ray starts: a bad spec fails in a second

    import ray

    from controller.sink import JsonlSink
    from controller.trackers import TrackerSink, with_trackers
    from controller.trainer import Trainer

    workdir = Path(args.workdir)
    address = args.ray_address or os.environ.get("RAY_ADDRESS") or None
    ray.init(address=address, namespace="tandem", logging_level="warning")
    name = args.name or workdir.name
    sink = with_trackers(JsonlSink(workdir, echo=True), spec, workdir, name)
    try:
        trainer = Trainer(spec, workdir, sink, name=name)
        last = trainer.run()
    finally:
        if isinstance(sink, TrackerSink):
            sink.close()
        ray.shutdown()
    print(json.dumps({"status": "succeeded", "step": trainer.step_index, "metrics": last}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
