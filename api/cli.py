"""The `tandem` command line: the parser, and how a command's errors are reported (one line on stderr,
`tandem: error: ...`, exit code 2 for bad input and 1 for everything else). The commands are in
api/cli_serve.py, cli_jobs.py and cli_resources.py; api/client.py says where they connect.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any

import httpx

from api.cli_format import printable
from api.cli_jobs import add_job_parsers
from api.cli_resources import add_resource_parsers
from api.cli_serve import add_serve_parser
from api.cli_spec import UsageError
from api.client import TandemAPIError, TandemClient, TandemError, every_page

HINT_401 = "set TANDEM_TOKEN or pass --token; the service's admin token is in $TANDEM_HOME/admin_token"
JOB_PREFIX = "job-"
FULL_ID_LENGTH = len("job-") + 12  # job- and 12 hex digits (service/store.py)


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

    def command(
        name: str,
        func: Callable,
        help: str,
        job: bool = True,
        under: Any = sub,
        client: bool = True,
        json: bool = False,
    ) -> argparse.ArgumentParser:
        """A subcommand (of `under`: the top level or a group's) calling `func(args, client)`, whose answer
        is the exit code (None: 0); `json`: it takes --json."""
        p = under.add_parser(
            name, help=help, description=help, parents=[conn] if client else [], allow_abbrev=False
        )
        if job:
            p.add_argument("job_id", metavar="ID")
        if json:
            p.add_argument("--json", action="store_true", help="print the service's JSON")
        p.set_defaults(func=func, client=client, subparser=p)
        return p

    add_serve_parser(sub)
    add_job_parsers(command)
    add_resource_parsers(command, sub)
    return parser


def resolve_job_id(client: TandemClient, given: str) -> str:
    """A job id from a unique prefix of it, with or without `job-`; a full id is taken as it is."""
    prefix = given if given.startswith(JOB_PREFIX) else JOB_PREFIX + given
    if len(prefix) >= FULL_ID_LENGTH:
        return prefix
    jobs = every_page(lambda after: client.list_jobs(limit=100, after=after))
    found = [j["id"] for j in jobs if j["id"].startswith(prefix)]
    if len(found) == 1:
        return found[0]
    if not found:
        raise TandemError(f"no job '{given}': no job id starts with it; `tandem list` shows them")
    shown = ", ".join(found[:10]) + (f" and {len(found) - 10} more" if len(found) > 10 else "")
    raise UsageError(f"job id prefix '{given}' is ambiguous: it matches {shown}")


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
            return args.func(args) or 0
        with TandemClient(args.url, args.token) as client:
            if client.token_in_clear:
                host = printable(httpx.URL(client.url).host)
                print(f"tandem: warning: sending the token over plain http to {host}, readable on the way; "
                      "use https", file=sys.stderr)  # fmt: skip
            if getattr(args, "job_id", None):
                args.job_id = resolve_job_id(client, args.job_id)
            return args.func(args, client) or 0
    except UsageError as err:  # a SpecError too
        return _fail(str(err), 2)
    except TandemAPIError as err:
        message = err.message if not err.param or err.param in err.message else f"{err.param}: {err.message}"
        return _fail(message + (f" ({HINT_401})" if err.status == 401 else ""), 2 if err.is_bad_input else 1)
    except TandemError as err:
        return _fail(str(err), 1)
    except KeyboardInterrupt:
        return 130


def _fail(message: str, code: int) -> int:
    print(f"tandem: error: {printable(message)}", file=sys.stderr)  # one line, whatever the server said
    return code


if __name__ == "__main__":
    sys.exit(main())
