"""`make run`: SFT, then GRPO from the SFT model, on the built-in 2-digit addition task, in minutes.

Stage 1 (examples/sft_arithmetic.yaml) trains the ~0.8M-parameter qwen2-1m model on the answers
("23+58=" -> "81") until its greedy accuracy on 200 held-out problems first reaches 0.3. Stage 2
(examples/grpo_arithmetic.yaml) starts from stage 1's HF export and learns from the rule reward
alone (1 for the right answer, else 0) with GRPO, taking the same accuracy past 0.8.

Both jobs run here, on a local Ray, through the same `Trainer` the service uses; their folders are
$TANDEM_HOME/jobs/<name> (events.jsonl, metrics.jsonl, checkpoints/, export/), replaced on every
run. A tqdm bar per job shows the step, the loss or mean reward, the last validation accuracy and
the time left. The measured curve is in bench/RESULTS.md.
"""

from __future__ import annotations

import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray
import yaml
from tqdm import tqdm

from controller.models import tandem_home
from controller.sink import JsonlSink
from controller.spec import JobSpec
from controller.trainer import Trainer

EXAMPLES = Path(__file__).resolve().parent


class ProgressSink(JsonlSink):
    """The job's JSONL record, plus a tqdm bar and the validation-accuracy curve."""

    def __init__(self, folder: Path, label: str, total: int) -> None:
        super().__init__(folder)
        self.bar = tqdm(total=total, desc=label, unit="step", dynamic_ncols=True)
        self.curve: dict[int, float] = {}  # step -> val accuracy

    def metrics(self, step: int, values: dict[str, float]) -> None:
        super().metrics(step, values)
        if "val/accuracy" in values:
            self.curve[step] = values["val/accuracy"]

    def progress(self, step: int, total: int, values: dict[str, float]) -> None:
        shown = {}
        if "sft/loss" in values:
            shown["loss"] = f"{values['sft/loss']:.3f}"
        if "critic/score/mean" in values:
            shown["reward"] = f"{values['critic/score/mean']:.2f}"
        if self.curve:
            shown["val_acc"] = f"{self.curve[max(self.curve)]:.2f}"
        self.bar.set_postfix(shown, refresh=False)
        self.bar.update(step - self.bar.n)

    def close(self) -> None:
        self.bar.total = self.bar.n  # a job that reached its accuracy target ends before total_steps
        self.bar.close()


@dataclass
class JobResult:
    workdir: Path
    curve: dict[int, float]
    minutes: float

    @property
    def steps(self) -> int:
        return max(self.curve)


def load_spec(file: str, **overrides: Any) -> JobSpec:
    return JobSpec.model_validate(yaml.safe_load((EXAMPLES / file).read_text())).merged(overrides)


def run_job(name: str, spec: JobSpec, label: str) -> JobResult:
    workdir = tandem_home() / "jobs" / name
    shutil.rmtree(workdir, ignore_errors=True)  # a fresh job, not a resume of the last run's
    sink = ProgressSink(workdir, label, spec.trainer.total_steps)
    start = time.perf_counter()
    try:
        Trainer(spec, workdir, sink, name=name).run()
    finally:
        sink.close()
    return JobResult(workdir, sink.curve, (time.perf_counter() - start) / 60)


def summary(sft: JobResult, grpo: JobResult, minutes: float) -> str:
    def line(label: str, job: JobResult) -> str:
        first, last = job.curve[0], job.curve[job.steps]
        return (
            f"  {label}: val accuracy {first:.2f} -> {last:.2f} in {job.steps} steps, "
            f"{job.minutes:.1f} min; export: {job.workdir / 'export'}"
        )

    return "\n".join(
        [
            f"Done in {minutes:.1f} minutes (val accuracy: greedy answers to held-out problems).",
            line("SFT ", sft),
            line("GRPO", grpo),
            f"  Job folders (events.jsonl, metrics.jsonl, checkpoints/, export/): {sft.workdir.parent}",
        ]
    )


def main() -> None:
    print("Tandem demo: SFT then GRPO on 2-digit addition with a ~0.8M-parameter model, on this CPU.")
    ray.init(
        num_cpus=os.cpu_count() or 1,
        include_dashboard=False,
        logging_level="error",
        log_to_driver=False,
        runtime_env={"env_vars": {"PYTHONPATH": str(EXAMPLES.parent), "TOKENIZERS_PARALLELISM": "false"}},
    )
    start = time.perf_counter()
    try:
        sft = run_job("sft-arithmetic", load_spec("sft_arithmetic.yaml"), "SFT ")
        grpo_spec = load_spec("grpo_arithmetic.yaml", model={"path": str(sft.workdir / "export")})
        grpo = run_job("grpo-arithmetic", grpo_spec, "GRPO")
    finally:
        ray.shutdown()
    print(summary(sft, grpo, (time.perf_counter() - start) / 60))


if __name__ == "__main__":
    main()
