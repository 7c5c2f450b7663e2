"""Watching a job from the terminal: a progress bar while it trains (`follow`: exit code 0 when it
succeeded, 1 otherwise), and live logs and events."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any, TextIO

from tqdm import tqdm

from api.cli_format import clock, printable
from api.client import TandemClient, every_page
from controller.metric_format import format_metric

REWARD_KEYS = ("critic/score/mean", "sft/loss")  # the headline number: RL reward, else SFT loss
VAL_KEY = "val/accuracy"
LABELS = {"critic/score/mean": "reward", "sft/loss": "loss", VAL_KEY: "val accuracy"}
BAR_FORMAT = "{desc} {n_fmt}/{total_fmt} |{bar:24}| {percentage:3.0f}% [{elapsed}{postfix}]"


class ProgressView:
    """The bar, the latest headline numbers, and an ETA from the pace of the steps seen."""

    def __init__(self, job: dict[str, Any], history: list[dict[str, Any]], out: TextIO) -> None:
        self.values: dict[str, float] = {}
        for row in history:
            self.values.update(row["values"])
        # Paced from the last step already recorded: time spent queued or starting is not a step's.
        self.since = (history[-1]["step"], history[-1]["time"]) if history else None
        self.bar = tqdm(total=job["total_steps"], initial=job["step"], desc=f"{printable(job['id'])} step",
                        bar_format=BAR_FORMAT, file=out, dynamic_ncols=True, mininterval=0.2)  # fmt: skip
        self._show(eta=None)

    def update(self, row: dict[str, Any]) -> None:
        self.values.update(row["values"])
        step, at = row["step"], row["time"]
        if step > self.bar.n:
            self.bar.update(step - self.bar.n)
        if self.since is None:
            self.since = (step, at)
        first_step, first_at = self.since
        pace = (at - first_at) / (step - first_step) if step > first_step else None
        self._show(eta=None if pace is None else pace * (self.bar.total - step))

    def _show(self, eta: float | None) -> None:
        parts = ["eta " + ("?" if eta is None else tqdm.format_interval(eta))]
        for key in REWARD_KEYS:
            if key in self.values:
                parts.append(f"{LABELS[key]}={format_metric(key, self.values[key])}")
                break
        if VAL_KEY in self.values:
            parts.append(f"val_acc={format_metric(VAL_KEY, self.values[VAL_KEY])}")
        self.bar.set_postfix_str(printable(", ".join(parts)), refresh=True)

    def close(self, step: int) -> None:
        if step > self.bar.n:
            self.bar.update(step - self.bar.n)
        self._show(eta=0.0 if self.bar.n >= self.bar.total else None)
        self.bar.close()


def follow(client: TandemClient, job_id: str, out: TextIO | None = None) -> int:
    """Show the job's progress (on stderr by default) until it is terminal; 0 if it succeeded, else 1."""
    job = client.get_job(job_id)
    history = client.metrics(job_id)["data"]
    view = ProgressView(job, history, out or sys.stderr)
    last_step = job["step"]
    try:
        for event in client.stream(job_id, "metrics", after=history[-1]["id"] if history else 0):
            if event.event == "metrics":
                view.update(event.data)
                last_step = max(last_step, event.data["step"])
    finally:
        view.close(last_step)
    job = client.get_job(job_id)
    print(
        summary(job, early_stop(client, job)), file=sys.stdout if job["status"] == "succeeded" else sys.stderr
    )
    return 0 if job["status"] == "succeeded" else 1


def early_stop(client: TandemClient, job: dict[str, Any]) -> str | None:
    """Why a job that succeeded before its last step stopped there (its `target_reached` event)."""
    if job["status"] != "succeeded" or job["step"] >= job["total_steps"]:
        return None
    reached = [e for e in _all_events(client, job["id"]) if e["kind"] == "target_reached"]
    if not reached:
        return None
    target = job["spec"]["trainer"].get("stop_at_val_accuracy")
    accuracy = reached[-1]["data"].get("accuracy")
    return (f"stopped at step {job['step']}/{job['total_steps']}: val accuracy {accuracy:.3f} reached "
            f"trainer.stop_at_val_accuracy {target}")  # fmt: skip


def _all_events(client: TandemClient, job_id: str) -> list[dict[str, Any]]:
    return every_page(lambda after: client.events(job_id, after=after or 0))


def summary(job: dict[str, Any], stopped: str | None = None) -> str:
    line = f"job {job['id']} {job['status']} at step {job['step']}/{job['total_steps']}"
    if stopped:
        line = f"job {job['id']} {job['status']}, {stopped}"
    latest = job["latest_metrics"]
    shown = [f"{label} {format_metric(k, latest[k])}" for k, label in LABELS.items() if k in latest]
    if shown:
        line += " (" + ", ".join(shown) + ")"
    if job.get("error"):
        line += f": {job['error']}"
    export = (job.get("outputs") or {}).get("export")
    line = printable(line)
    if export:  # the next stage's `--model`, e.g. GRPO after SFT
        line += f"\nexport: {printable(export)}"
    return line


def event_line(event: dict[str, Any]) -> str:
    return printable(f"{clock(event['time'])}  {event['kind']:<26} {event['message']}")


def print_events(args: argparse.Namespace, client: TandemClient) -> None:
    """`tandem events`: every event of the job; with --follow, then new ones until the job ends."""
    events = _all_events(client, args.job_id)
    return _print_rows(args, client, "events", events, event_line)


def print_logs(args: argparse.Namespace, client: TandemClient) -> None:
    """`tandem logs`: the job's last --tail lines; with --follow, then new ones until the job ends."""
    rows = client.logs(args.job_id, tail=args.tail)["data"]
    return _print_rows(args, client, "logs", rows, lambda row: printable(row["line"]))


def _print_rows(
    args: argparse.Namespace,
    client: TandemClient,
    what: str,
    rows: list[dict[str, Any]],
    line: Callable[[dict[str, Any]], str],
) -> None:
    for row in rows:
        print(line(row), flush=True)
    if args.follow:
        for sse in client.stream(args.job_id, what, after=rows[-1]["id"] if rows else 0):
            if sse.event != "end":
                print(line(sse.data), flush=True)
