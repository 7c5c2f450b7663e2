"""The job commands of `tandem` (submit, list, status, follow, logs, events, metrics, cancel, pause,
resume, fork, set, checkpoints, samples), each over the service's REST API."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from api.cli_format import clock, duration, printable, table
from api.cli_spec import (
    UsageError,
    absolutize_paths,
    build_spec,
    deep_merge,
    parse_assignments,
    parse_value,
    validate,
)
from api.cli_watch import follow, print_events, print_logs
from api.client import TandemClient, TandemError
from controller.metric_format import format_metric
from service.job_state import ACTIVE

METRIC_KEYS = ("critic/score/mean", "val/accuracy", "actor/pg_loss", "sft/loss", "actor/lr", "timing_s/step")


def _submit(args: argparse.Namespace, client: TandemClient) -> int | None:
    if not (args.file or args.method or args.model or args.set) and args.steps is None:
        raise UsageError("give a spec file and/or flags (--method, --model, --steps, --set key.path=value)")
    given, _ = build_spec(args.file, args.method, args.model, args.steps, args.set)
    if args.dry_run:  # the service's own checks (models, files, reward function, cluster size)
        print(json.dumps(client.validate_job(given)["spec"], indent=2))
        return None
    job = client.create_job(given, args.idempotency_key)
    print(printable(job["id"]), flush=True)
    if args.follow:
        return follow(client, job["id"])
    print(printable(f"{job['status']}: follow it with `tandem follow {job['id']}`"), file=sys.stderr)


def shown(args: argparse.Namespace, data: Any, render: Callable[[Any], str]) -> None:
    """Print `data` as JSON with --json, else as `render` writes it for a person."""
    print(json.dumps(data, indent=2) if getattr(args, "json", False) else render(data))


def _list(args: argparse.Namespace, client: TandemClient) -> None:
    shown(args, client.list_jobs(args.status, args.limit)["data"], _jobs_table)


def _jobs_table(jobs: list[dict[str, Any]]) -> str:
    header = ("ID", "STATUS", "OWNER", "METHOD", "MODEL", "STEP", "REWARD", "STARTED", "DURATION")
    rows = [(j["id"], shown_status(j), j["owner"], j["method"], j["model"], f"{j['step']}/{j['total_steps']}",
             format_metric("critic/score/mean", j["latest_metrics"].get("critic/score/mean")), clock(j["started_at"]),
             duration(j["started_at"], j["finished_at"])) for j in jobs]  # fmt: skip
    return table(header, rows) if rows else "no jobs"


def shown_status(job: dict) -> str:
    """The job's state, or, while its workers restart, what happened: 'restarting (1/3): worker rank 0
    died (waiting for resources)'."""
    restart = job.get("restart")
    if not restart or job["status"] not in ACTIVE:
        return job["status"]
    return f"{restart['message']} ({restart['phase']})"


def _status(args: argparse.Namespace, client: TandemClient) -> None:
    shown(args, client.get_job(args.job_id), _facts)


def _facts(job: dict[str, Any]) -> str:
    facts = {
        "id": job["id"],
        "status": shown_status(job),
        "method": job["method"],
        "model": job["model"],
        "step": f"{job['step']}/{job['total_steps']} ({job['progress']:.0%})",
        "created": clock(job["created_at"]),
        "started": clock(job["started_at"]),
        "finished": clock(job["finished_at"]),
        "duration": duration(job["started_at"], job["finished_at"]),
        "parent": job["parent_id"] or "-",
        "error": job["error"] or "-",
    }
    lora = job.get("lora")
    if lora:
        size = lora["adapter_bytes"]
        facts["lora"] = (
            f"rank {lora['rank']}, {lora['trainable_parameters'] or '?'} trainable parameters, "
            f"adapter {size / 1e6:.2f} MB"
            if size
            else f"rank {lora['rank']} (sizes after the first sync)"
        )
    latest = job["latest_metrics"]
    facts.update(
        {k: format_metric(k, latest[k]) for k in METRIC_KEYS if k in latest}
    )  # `tandem metrics` has all
    width = max(len(k) for k in facts)
    return "\n".join(f"{k:<{width}}  {printable(v)}" for k, v in facts.items())


def _follow(args: argparse.Namespace, client: TandemClient) -> int:
    return follow(client, args.job_id)


def _metrics(args: argparse.Namespace, client: TandemClient) -> None:
    keys = [k.strip() for k in (args.keys or "").split(",") if k.strip()] or None
    rows = metric_rows(client, args.job_id, keys, args.every, args.last)
    present = {k for row in rows for k in row["values"]}
    columns = keys or [k for k in METRIC_KEYS if k in present]
    body = [(str(row["step"]), *(format_metric(k, row["values"].get(k)) for k in columns)) for row in rows]
    shown(args, rows, lambda _: table(("STEP", *columns), body) if body else "no metrics yet")


def metric_rows(
    client: TandemClient, job_id: str, keys: list[str] | None, every: int | None, last: int | None
) -> list[dict[str, Any]]:
    """The rows `tandem metrics` prints: the steps that are multiples of `every` plus the latest, then
    the last `last` of them. With `keys`, only steps that recorded one count (validation metrics exist
    only every val_every steps), so that filter and `last` run here."""
    server_last = None if keys else last
    rows = client.metrics(job_id, keys, every=every, last=server_last)["data"]
    if every:  # the latest step too, so that the table ends where the job is
        latest = client.metrics(job_id, keys, last=1)["data"]
        rows += [r for r in latest if not rows or r["step"] > rows[-1]["step"]]
    if keys:
        rows = [r for r in rows if any(r["values"].get(k) is not None for k in keys)]
    return rows[-last:] if last else rows


def _control(args: argparse.Namespace, client: TandemClient) -> None:
    job = client.control(args.job_id, args.command)  # cancel, pause or resume
    if getattr(args, "wait", False):
        job = _settled(client, job)
    print(printable(f"{job['id']}: {job['status']}"))


def _settled(client: TandemClient, job: dict, timeout_s: float = 600.0) -> dict:
    """The job once it has left `pausing` or `cancelling`, so that `tandem pause JOB --wait && tandem
    resume JOB` holds."""
    deadline = time.monotonic() + timeout_s
    while job["status"] in ("pausing", "cancelling"):
        if time.monotonic() > deadline:
            raise TandemError(f"job {job['id']} is still {job['status']} after {timeout_s:.0f} s")
        time.sleep(0.5)
        job = client.get_job(job["id"])
    return job


def _fork(args: argparse.Namespace, client: TandemClient) -> int:
    overrides = absolutize_paths(parse_assignments(args.set or []), Path.cwd(), strict=True)
    if args.steps is not None:
        overrides = deep_merge(overrides, {"trainer": {"total_steps": args.steps}})
    if overrides:  # the child's spec, validated here so a bad override names its field
        validate(deep_merge(client.get_job(args.job_id)["spec"], overrides))
    child = client.fork(args.job_id, args.step, overrides)
    print(printable(child["id"]), flush=True)
    return follow(client, child["id"]) if args.follow else 0


def _set(args: argparse.Namespace, client: TandemClient) -> None:
    changes: dict[str, Any] = {}
    for item in args.assignments:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise UsageError(f"'{item}' must be 'name=value', e.g. lr=1e-4")
        changes[key] = parse_value(value)
    client.set_hyperparameters(args.job_id, changes)
    done = ", ".join(f"{k}={v}" for k, v in changes.items())
    print(printable(f"{args.job_id}: requested for the next step: {done}"))


def _checkpoints(args: argparse.Namespace, client: TandemClient) -> None:
    saved = client.checkpoints(args.job_id)["data"]
    rows = [(str(c["step"]), clock(c["time"]), c["path"]) for c in saved]
    shown(args, saved, lambda _: table(("STEP", "SAVED", "PATH"), rows) if rows else "no checkpoints yet")


def _samples(args: argparse.Namespace, client: TandemClient) -> None:
    step = args.step if args.step is not None else client.get_job(args.job_id)["step"]
    rows = client.samples(args.job_id, step=step, limit=args.limit)["data"]
    shown(args, rows, lambda _: "\n\n".join(map(format_sample, rows)) or f"no samples of step {step}")


def format_sample(row: dict[str, Any]) -> str:
    """A trajectory's head line and turns; a Tinker sampler's sample (no reward, nothing trained) names
    its sampler instead."""
    tokens = row.get("tokens", {})
    parts = [f"── step {row['step']} · sample {row.get('index', '?')}"]
    reward = row.get("reward")
    if isinstance(reward, int | float):
        parts.append(f"reward {reward:.3g}")
    if row.get("sampler"):
        parts.append(f"sampler {row['sampler']}")
    parts.append(row.get("finish_reason") or "?")
    trained = tokens.get("trained")
    parts.append(f"{trained}/{tokens.get('response', '?')} response tokens trained" if trained is not None
                 else f"{tokens.get('response', '?')} response tokens")  # fmt: skip
    head = " · ".join(parts)
    lines = [printable(head), f"[prompt] {printable(row.get('prompt', ''), lines=True)}"]
    lines += [
        f"[{printable(turn['role'])}] {printable(turn['content'], lines=True)}"
        for turn in row.get("turns", [])
    ]
    if row.get("error"):
        lines.append(f"[error] {printable(row['error'], lines=True)}")
    return "\n".join(lines)


def positive(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def add_job_parsers(command: Callable[..., argparse.ArgumentParser]) -> None:
    p = command("submit", _submit, "submit a job from a spec file (YAML/JSON) and/or flags", job=False)
    p.add_argument("file", nargs="?", help="a JobSpec as YAML or JSON (see examples/)")
    p.add_argument("--method", help="sft, grpo, ppo, rloo, reinforce_pp, reinforce_pp_baseline")
    p.add_argument("--model", help="a built-in model name (e.g. tiny-qwen2) or a local HF folder")
    p.add_argument("--steps", type=int, help="trainer.total_steps")
    p.add_argument("--set", action="append", metavar="KEY.PATH=VALUE", help="any JobSpec field; repeatable")
    p.add_argument("--idempotency-key", help="a retried submission with the same key returns the first job")
    p.add_argument("--dry-run", action="store_true", help="print the validated spec; submit nothing")
    p.add_argument("-f", "--follow", action="store_true", help="show a progress bar until the job ends")
    p = command("list", _list, "list jobs, newest first", job=False, json=True)
    p.add_argument("--status", action="append", help="only jobs in this state; repeatable")
    p.add_argument("--limit", type=int, default=20)
    command("status", _status, "a job's state, progress and latest metrics", json=True)
    command("follow", _follow, "a progress bar until the job ends (exit 0 if it succeeded)")
    p = command("logs", print_logs, "a job's log lines")
    p.add_argument("--tail", type=int, default=200)
    p.add_argument("-f", "--follow", action="store_true", help="keep printing new lines until the job ends")
    command("events", print_events, "a job's events").add_argument("-f", "--follow", action="store_true")
    p = command("metrics", _metrics, "a job's metrics per step", json=True)
    p.add_argument("--keys", help="comma-separated metric names (default: the headline ones)")
    p.add_argument("--last", type=positive, metavar="N", help="only the last N rows")
    p.add_argument(
        "--every", type=positive, metavar="N", help="only steps that are multiples of N (and the latest)"
    )
    for action in ("cancel", "pause", "resume"):
        p = command(action, _control, f"{action} a job")
        if action != "resume":
            p.add_argument("--wait", action="store_true", help="return once the job is paused or cancelled")
    p = command("fork", _fork, "a new job from one of a job's checkpoints, with changes")
    p.add_argument("--step", type=int, help="the checkpoint's step (default: the latest)")
    p.add_argument("--steps", type=int, help="the child's trainer.total_steps (above the checkpoint's step)")
    p.add_argument("--set", action="append", metavar="KEY.PATH=VALUE", help="a JobSpec change; repeatable")
    p.add_argument("-f", "--follow", action="store_true")
    p = command("set", _set, "change hyper-parameters of a running job from its next step")
    p.add_argument("assignments", nargs="+", metavar="NAME=VALUE", help="e.g. lr=1e-4 temperature=0.8")
    command("checkpoints", _checkpoints, "a job's saved checkpoints", json=True)
    p = command(
        "samples", _samples, "a step's sampled trajectories, as a chat (default: the latest step)", json=True
    )
    p.add_argument("--step", type=int, help="the step (default: the job's latest)")
    p.add_argument("--limit", type=int, default=8)
