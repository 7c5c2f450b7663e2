"""Weights & Biases: one run per job, online when the machine is logged in (WANDB_API_KEY or
`wandb login`), else offline under the job's folder (`wandb/`, for `wandb sync` later); WANDB_MODE
decides when set. The run's id is the job's own, so a resumed job continues it; a fork's run
records its parent's run in its config (`forked_from`) and tags.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from controller.trackers.base import RunInfo, log, sample_table


def wandb_mode() -> str:
    if os.environ.get("WANDB_MODE"):
        return os.environ["WANDB_MODE"]
    netrc = Path.home() / ".netrc"
    logged_in = os.environ.get("WANDB_API_KEY") or (netrc.exists() and "api.wandb.ai" in netrc.read_text())
    return "online" if logged_in else "offline"


class WandbTracker:
    name = "wandb"

    def open(self, info: RunInfo) -> str:
        import wandb

        mode = wandb_mode()
        config = dict(info.config)
        tags = [info.job_id]
        if info.parent_ids.get(self.name):
            config["forked_from"] = {"job": info.parent_job, "wandb_run": info.parent_ids[self.name]}
            tags.append(f"fork-of-{info.parent_job}")
        self.run = wandb.init(
            project=info.project, id=info.run_ids.get(self.name) or info.job_id.replace("job-", ""),
            name=info.job_id, resume="allow", dir=str(info.workdir), config=config, tags=tags, mode=mode,
            reinit="create_new", settings=wandb.Settings(
                # No console capture, system-metrics sampler, git or package scan: they cost CPU that
                # the job's controller needs, and the job records its own logs and environment.
                silent=True, console="off", x_disable_stats=True, x_disable_meta=True,
                x_disable_machine_info=True, x_save_requirements=False, disable_git=True,
            ),
        )  # fmt: skip
        log.info("wandb: run %s (%s)", self.run.id, mode)
        return self.run.id

    def metrics(self, step: int, values: dict[str, float]) -> None:
        self.run.log(values, step=step)

    def hyperparameters(self, step: int, changes: dict[str, Any]) -> None:
        self.run.config.update(changes, allow_val_change=True)
        numbers = {f"hparams/{k}": v for k, v in changes.items() if isinstance(v, int | float)}
        if numbers:
            self.run.log(numbers, step=step)

    def samples(self, step: int, rows: list[dict[str, Any]]) -> None:
        import wandb

        columns, data = sample_table(step, rows)
        self.run.log({"samples": wandb.Table(columns=columns, data=data)}, step=step)

    def close(self) -> None:
        self.run.finish()
