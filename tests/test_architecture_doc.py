"""docs/ARCHITECTURE.md against the repository: every path and Python name it quotes exists, and it stays
a page a newcomer reads in one sitting (at most 500 lines). Read without importing anything: a name is
found in its module's syntax tree, so the check needs no torch and no Ray."""

from __future__ import annotations

import ast
import glob
import re
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "ARCHITECTURE.md"
MAX_LINES = 500
PACKAGES = ("api", "service", "controller", "workers", "engines", "schema")
FOLDERS = (*PACKAGES, "tests", "bench", "docs", "examples", "deploy")
# `engines/rollout/hf.py`, `controller/external*.py`, `workers/x.py:fn`, `workers/losses/tinker.compute_loss`
PATH = re.compile(rf"(?:{'|'.join(FOLDERS)})/[\w./*{{}},-]*")
# `workers.losses.registry.LOSSES`, `controller.job_actor:JobController`
DOTTED = re.compile(rf"(?:{'|'.join(PACKAGES)})\.[\w.]+(?::[\w.]+)?")
FILE_NAME = re.compile(r"\w+\.(?:py|json|md|yml|yaml|pt|c)")
# a path written in the prose without backticks: `(tests/test_x.py)`
BARE = re.compile(rf"(?<![\w/.`-])(?:{'|'.join(FOLDERS)})/[\w/-]+\.(?:py|md|c|proto|js|html|json|yaml|yml)\b")


def expand(path: str) -> list[str]:
    """`a/{b,c}.py` -> [`a/b.py`, `a/c.py`]."""
    found = re.search(r"\{([^{}]*)\}", path)
    if not found:
        return [path]
    return [
        x for part in found[1].split(",") for x in expand(path[: found.start()] + part + path[found.end() :])
    ]


@cache
def names_in(module: Path) -> dict[str, ast.AST]:
    """What a module defines or imports at its top level, with the node that defines it."""
    tree = ast.parse(module.read_text())
    defined: dict[str, ast.AST] = {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            defined[node.name] = node
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                for name in ast.walk(target):
                    if isinstance(name, ast.Name):
                        defined[name.id] = node
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                defined[(alias.asname or alias.name).split(".")[0]] = node
    return defined


def attribute_error(module: Path, chain: list[str]) -> str | None:
    """None when `chain[0]` is defined in `module` (and `chain[1]`, if any, is named in that class)."""
    node = names_in(module).get(chain[0])
    if node is None:
        return f"{module.relative_to(ROOT)} defines no {chain[0]!r}"
    if len(chain) > 1 and isinstance(node, ast.ClassDef):
        source = ast.get_source_segment(module.read_text(), node) or ""
        if not re.search(rf"\b{re.escape(chain[1])}\b", source):
            return f"class {chain[0]} in {module.relative_to(ROOT)} names no {chain[1]!r}"
    return None


def module_file(parts: list[str]) -> Path | None:
    candidate = ROOT.joinpath(*parts)
    if candidate.with_suffix(".py").is_file():
        return candidate.with_suffix(".py")
    if (candidate / "__init__.py").is_file():
        return candidate / "__init__.py"
    return None


def resolve_dotted(parts: list[str], attrs: list[str]) -> str | None:
    """The longest prefix of `parts` that is a module; the rest (then `attrs`) are names in it."""
    for cut in range(len(parts), 0, -1):
        module = module_file(parts[:cut])
        if module is not None:
            chain = parts[cut:] + attrs
            return attribute_error(module, chain) if chain else None
    return f"no module {'.'.join(parts)}"


def problem(ref: str) -> str | None:
    """Why `ref`, a path or a dotted name quoted on the page, names nothing in the repository."""
    if DOTTED.fullmatch(ref):
        dotted, _, attr = ref.partition(":")
        return resolve_dotted(dotted.split("."), attr.split(".") if attr else [])
    path, _, attr = ref.partition(":")
    for one in expand(path.rstrip("/")):
        if "*" in one:
            if not glob.glob(str(ROOT / one)):
                return f"nothing matches {one}"
            continue
        if (ROOT / one).exists():
            if attr:
                error = attribute_error(ROOT / one, attr.split("."))
                if error:
                    return error
            continue
        # `workers/losses/aggregation.aggregate`: a module's path, then a name in it.
        folder, _, last = one.rpartition("/")
        stem, _, rest = last.partition(".")
        if not rest or rest.split(".")[0] in ("py", "md"):
            return f"no file {one}"
        error = resolve_dotted(
            [*folder.split("/"), stem], rest.split(".") + (attr.split(".") if attr else [])
        )
        if error:
            return error
    return None


def quoted() -> set[str]:
    text = PAGE.read_text()
    spans = re.findall(r"`([^`\n]+)`", text)
    # `workers.py` beside `schema/`, `service.json` in the home: file names, not dotted names
    refs = {s for s in spans if PATH.fullmatch(s) or (DOTTED.fullmatch(s) and not FILE_NAME.fullmatch(s))}
    # paths in the prose and in the page's diagrams, with or without backticks
    return refs | set(BARE.findall(text))


def test_every_path_and_name_the_page_quotes_exists() -> None:
    missing = sorted(f"{ref}: {why}" for ref in quoted() if (why := problem(ref)))
    assert not missing, "docs/ARCHITECTURE.md quotes what is not in the repository:\n" + "\n".join(missing)


def test_the_checker_catches_a_stale_reference() -> None:
    assert problem("engines/megatron/engine.py") == "no file engines/megatron/engine.py"
    assert problem("workers/losses/registry.NO_SUCH_NAME")
    assert problem("controller.job_actor:NoSuchRunner")
    assert problem("workers/environments/openenv_{ref,nothing}.py")
    assert problem("engines/rollout/constrained*.py") is None
    assert problem("workers/losses/registry.LOSSES") is None
    assert problem("controller.job_actor:JobController") is None


def test_the_page_is_at_most_500_lines() -> None:
    lines = len(PAGE.read_text().splitlines())
    assert lines <= MAX_LINES, f"docs/ARCHITECTURE.md has {lines} lines; the map stays at most {MAX_LINES}"
