"""`tandem serve --quota-...` and `--quotas FILE`: the operator's quotas per owner (service/quotas.py).

The flags set the default quota, which applies to every owner but the admin; a quotas file may also
set per-owner quotas, and the flags win over its default. An admin changes them live with
`PUT /v1/quotas/{owner}` (until the service restarts)."""

from __future__ import annotations

import argparse
from typing import Any

GiB = 1024**3


def add_quota_flags(serve: argparse.ArgumentParser) -> None:
    group = serve.add_argument_group("quotas per owner (default: unlimited; the admin is never limited)")
    group.add_argument(
        "--quotas", metavar="FILE", help="JSON or YAML: {default: {...}, owners: {NAME: {...}}}"
    )
    group.add_argument("--quota-running-jobs", type=int, metavar="N", help="jobs running at once")
    group.add_argument("--quota-queued-jobs", type=int, metavar="N", help="jobs queued at once (429 beyond)")
    group.add_argument("--quota-cpus", type=float, metavar="N", help="CPUs held by an owner's running jobs")
    group.add_argument("--quota-gpus", type=float, metavar="N", help="GPUs held by an owner's running jobs")
    group.add_argument(
        "--quota-stored-gb", type=float, metavar="GB", help="uploads, checkpoints and exports (403 beyond)"
    )


def quota_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The ServeSettings fields the quota flags give."""
    default = {
        "running_jobs": args.quota_running_jobs,
        "queued_jobs": args.quota_queued_jobs,
        "cpus": args.quota_cpus,
        "gpus": args.quota_gpus,
        "stored_bytes": int(args.quota_stored_gb * GiB) if args.quota_stored_gb is not None else None,
    }
    return {"quotas_file": args.quotas, "default_quota": {k: v for k, v in default.items() if v is not None}}
