"""The `tandem` command line: run the service, and build the built-in models."""

from __future__ import annotations

import argparse
import sys


def _serve(args: argparse.Namespace) -> int:
    from api.server import serve

    serve(args.host, args.port, args.home, args.ray_address, args.num_cpus)
    return 0


def _models_build(args: argparse.Namespace) -> int:
    from controller.models import builtin_model_path
    from engines.tiny_models import BUILTIN_MODELS

    if args.name not in BUILTIN_MODELS:
        print(f"tandem: unknown built-in model '{args.name}'; choose one of {', '.join(sorted(BUILTIN_MODELS))}",
              file=sys.stderr)  # fmt: skip
        return 2
    print(builtin_model_path(args.name))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tandem", description="Tandem: RL post-training jobs on Ray.")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run the API service (a long-lived Ray driver)")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--home", default=None, help="data directory (default: $TANDEM_HOME or ~/.tandem)")
    serve.add_argument("--ray-address", default=None, help="join a cluster: 'auto' or 'ray://host:10001'")
    serve.add_argument("--num-cpus", type=int, default=None, help="CPUs of a local Ray cluster")
    serve.set_defaults(func=_serve)
    models = sub.add_parser("models", help="built-in tiny models").add_subparsers(
        dest="models_command", required=True
    )
    build = models.add_parser("build", help="build a built-in model in HF format; prints its folder")
    build.add_argument("name")
    build.set_defaults(func=_models_build)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
