"""`tandem serve`: run the API service (a long-lived Ray driver) with the operator's settings.

Each flag sets a ServeSettings field (api/settings.py), and its help is that field's description; values
are validated there, so a bad one is one line naming the field, not a traceback. The --quota-* flags set
the default quota (every owner's but the admin's), over a quotas file's default.
"""

from __future__ import annotations

import argparse
from typing import Any, get_args, get_origin

from pydantic import ValidationError
from pydantic.fields import FieldInfo

from api.cli_spec import UsageError, describe
from api.settings import MiB, ServeSettings
from service.quotas import Quota

GiB = 1024**3
# --flag: the field it sets, its metavar, and how many of the field's units one of the flag's is
SETTINGS_FLAGS = {
    "allow-path": ("allowed_paths", "DIR", 1),
    "allow-tracker-host": ("tracker_hosts", "HOST[:PORT]", 1),
    "allow-wandb": ("allow_wandb", None, 1),
    "max-body-mb": ("max_body_bytes", "MB", MiB),
    "max-upload-mb": ("max_upload_bytes", "MB", MiB),
    "user-code-timeout": ("user_code_timeout_s", None, 1),
    "unsandboxed-user-code": ("unsandboxed_user_code", None, 1),
    "base-model": ("tinker_base_models", "NAME_OR_PATH", 1),
    "max-lora-rank": ("tinker_max_rank", None, 1),
    "warm-controllers": ("warm_controllers", None, 1),
}
QUOTA_FLAGS = {  # --quota-NAME: a Quota field
    "quota-running-jobs": ("running_jobs", "N", 1),
    "quota-queued-jobs": ("queued_jobs", "N", 1),
    "quota-cpus": ("cpus", "N", 1),
    "quota-gpus": ("gpus", "N", 1),
    "quota-stored-gb": ("stored_bytes", "GB", GiB),
}


def serve_command(args: argparse.Namespace) -> None:
    from api.server import serve  # Ray and uvicorn: only `tandem serve` imports them

    try:
        settings = ServeSettings(**given_settings(args))
    except ValidationError as err:  # a bad option is one line naming it, not a traceback
        raise UsageError(f"tandem serve: {describe(err)}") from None
    serve(args.host, args.port, args.home, args.ray_address, args.num_cpus, settings=settings)


def given_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The ServeSettings fields the flags set, in the fields' units; the others keep their defaults."""

    def given(flags: dict[str, tuple[str, str | None, int]]) -> dict[str, Any]:
        values = {
            field: (getattr(args, flag.replace("-", "_")), scale) for flag, (field, _, scale) in flags.items()
        }
        return {f: v if scale == 1 else int(v * scale) for f, (v, scale) in values.items() if v is not None}

    return {**given(SETTINGS_FLAGS), "quotas_file": args.quotas, "default_quota": given(QUOTA_FLAGS)}


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
    add_field_flags(serve, SETTINGS_FLAGS, ServeSettings.model_fields)
    quotas = serve.add_argument_group("quotas per owner (default: unlimited; the admin is never limited)")
    quotas.add_argument(
        "--quotas", metavar="FILE", help=ServeSettings.model_fields["quotas_file"].description
    )
    add_field_flags(quotas, QUOTA_FLAGS, Quota.model_fields)
    serve.set_defaults(func=serve_command, client=False, subparser=serve)


def add_field_flags(
    parser: Any, flags: dict[str, tuple[str, str | None, int]], fields: dict[str, FieldInfo]
) -> None:
    """One option per flag, its kind from the field's type: a bool is a switch, a list is repeatable."""
    for flag, (name, metavar, scale) in flags.items():
        field = fields[name]
        kind = field.annotation
        if type(None) in get_args(kind):  # X | None: X
            kind = next(a for a in get_args(kind) if a is not type(None))
        if kind is bool:
            options: dict[str, Any] = {"action": "store_true", "default": None}
        elif get_origin(kind) is list:
            options = {"action": "append", "metavar": metavar}
        else:
            options = {"type": float if scale != 1 else kind, "metavar": metavar}
        help = field.description + ("; repeatable" if get_origin(kind) is list else "")
        help += f"; given in {metavar}" if scale != 1 else ""
        parser.add_argument(f"--{flag}", help=help, **options)
