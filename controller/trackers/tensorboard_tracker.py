"""TensorBoard: event files under the job's folder (`tensorboard/`), read by `tensorboard --logdir`.

Metrics are scalars under their own names; a hyper-parameter change is a scalar `hparams/NAME` at
the step it applies from, plus a text entry; the spec and the stored samples are text (Markdown
tables). A resumed job appends to the same folder, so its curves continue.
"""

from __future__ import annotations

import json
from typing import Any

from controller.trackers.base import RunInfo, sample_table


class TensorBoardTracker:
    name = "tensorboard"

    def open(self, info: RunInfo) -> str:
        from torch.utils.tensorboard import SummaryWriter  # the tensorboard package writes the files

        self.logdir = info.workdir / "tensorboard"
        self.writer = SummaryWriter(log_dir=str(self.logdir), flush_secs=10)
        if not info.run_ids.get(self.name):  # the first start: the spec, and the parent of a fork
            self.writer.add_text("spec", "```\n" + json.dumps(info.config, indent=1) + "\n```", 0)
            if info.parent_job:
                self.writer.add_text("forked_from", info.parent_job, 0)
        return str(self.logdir)

    def metrics(self, step: int, values: dict[str, float]) -> None:
        for key, value in values.items():
            self.writer.add_scalar(key, value, step)

    def hyperparameters(self, step: int, changes: dict[str, Any]) -> None:
        for key, value in changes.items():
            if isinstance(value, int | float):
                self.writer.add_scalar(f"hparams/{key}", value, step)
        self.writer.add_text("hyperparameters", json.dumps(changes), step)

    def samples(self, step: int, rows: list[dict[str, Any]]) -> None:
        columns, data = sample_table(step, rows)
        cell = lambda v: str(v).replace("|", "\\|").replace("\n", "<br>")  # noqa: E731
        lines = ["| " + " | ".join(columns) + " |", "|" + " --- |" * len(columns)]
        lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in data]
        self.writer.add_text("samples", "\n".join(lines), step)

    def close(self) -> None:
        self.writer.close()
