"""`tandem serve`: run the API service (a long-lived Ray driver) with the operator's settings.

Each flag is a ServeSettings field (api/settings.py), validated there: a bad value is one line naming
the option, not a traceback. The quota flags set the default quota (every owner's but the admin's),
over a quotas file's default.
"""

from __future__ import annotations

import argparse
from typing import Any

from api.cli_spec import UsageError, describe

GiB = 1024**3


def serve_command(args: argparse.Namespace) -> int:
    from pydantic import ValidationError

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


def add_serve_parser(sub: Any) -> None:
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
    serve.set_defaults(func=serve_command, client=False, subparser=serve)


# --quota-NAME: the Quota field it sets (--quota-stored-gb in GB), its type, metavar and help
QUOTA_FLAGS = {
    "running-jobs": ("running_jobs", int, "N", "jobs running at once"),
    "queued-jobs": ("queued_jobs", int, "N", "jobs queued at once (429 beyond)"),
    "cpus": ("cpus", float, "N", "CPUs held by an owner's running jobs"),
    "gpus": ("gpus", float, "N", "GPUs held by an owner's running jobs"),
    "stored-gb": ("stored_bytes", float, "GB", "uploads, checkpoints and exports (403 beyond)"),
}


def add_quota_flags(serve: argparse.ArgumentParser) -> None:
    group = serve.add_argument_group("quotas per owner (default: unlimited; the admin is never limited)")
    group.add_argument(
        "--quotas", metavar="FILE", help="JSON or YAML: {default: {...}, owners: {NAME: {...}}}"
    )
    for flag, (_, kind, metavar, help) in QUOTA_FLAGS.items():
        group.add_argument(f"--quota-{flag}", type=kind, metavar=metavar, help=help)


def quota_settings(args: argparse.Namespace) -> dict[str, Any]:
    default = {
        field: getattr(args, "quota_" + flag.replace("-", "_")) for flag, (field, *_) in QUOTA_FLAGS.items()
    }
    if default["stored_bytes"] is not None:
        default["stored_bytes"] = int(default["stored_bytes"] * GiB)
    return {"quotas_file": args.quotas, "default_quota": {k: v for k, v in default.items() if v is not None}}
