"""The user's pages against the code they describe, without a service: code shown as a file's is that
file's, every curl that sends JSON says so, every variable a block uses is set on the page before it,
a fork's `--step` names a checkpoint the example it forks keeps, a page puts `tandem` on PATH before
it runs it, and a ratio a page quotes is the one in bench/RESULTS.md's current table.
(tests/test_docs_run.py runs the pages.)"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import tomllib
import yaml

ROOT = Path(__file__).resolve().parents[1]
PAGES = [
    ROOT / "README.md",
    *sorted((ROOT / "docs").glob("*.md")),
    *sorted((ROOT / "docs" / "guides").glob("*.md")),
]
PAGES = [p for p in PAGES if p.name != "ARCHITECTURE.md"]
BLOCK = re.compile(r"```(\w+)\n(.*?)```", re.S)
SHELL_VARS = {"PWD", "HOME", "PATH"}


def blocks(page: Path, kind: str) -> list[str]:
    return [body for lang, body in BLOCK.findall(page.read_text()) if lang == kind]


def named(page: Path) -> str:
    return str(page.relative_to(ROOT))


@pytest.mark.parametrize("page", PAGES, ids=named)
def test_code_shown_as_a_files_is_that_files(page: Path) -> None:
    for body in blocks(page, "python"):
        first, _, rest = body.partition("\n")
        found = re.fullmatch(r"# (examples/\S+\.py)", first.strip())
        if not found:
            continue
        source = (ROOT / found.group(1)).read_text()
        header, _, code = rest.partition("\n")
        if header.startswith("class "):
            assert re.search(rf"^{re.escape(header.rstrip())}", source, re.M), (named(page), header)
        else:
            code = rest
        assert code.strip(), named(page)
        at = 0  # a line of `...` leaves lines out; what is shown is the file's, in its order
        for part in re.split(r"^\s*\.\.\.\s*\n", code, flags=re.M):
            found_at = source.find(part.rstrip("\n"), at)
            assert found_at >= 0, (
                f"{named(page)}: the block shown as {found.group(1)} differs from it: {part!r}"
            )
            at = found_at + len(part.rstrip("\n"))


@pytest.mark.parametrize("page", PAGES, ids=named)
def test_curl_with_a_json_body_sends_its_content_type(page: Path) -> None:
    for body in blocks(page, "bash"):
        for command in re.split(r"(?<!\\)\n", body):
            if command.lstrip().startswith("curl") and re.search(r"\s-d\s", command):
                assert "Content-Type: application/json" in command, f"{named(page)}: {command}"


@pytest.mark.parametrize("page", PAGES, ids=named)
def test_every_variable_a_block_uses_is_set_on_the_page_first(page: Path) -> None:
    defined = set(SHELL_VARS)
    for body in blocks(page, "bash"):
        code = re.sub(r"#.*", "", body)
        for name in re.findall(r"\$\{?([A-Z_][A-Z0-9_]*)", code):
            assert name in defined or re.search(rf"\b{name}=", code), (
                f"{named(page)} uses ${name} before setting it"
            )
        defined |= set(re.findall(r"\b([A-Z_][A-Z0-9_]*)=", code))


def kept_checkpoints(spec_file: str) -> list[int]:
    spec = yaml.safe_load((ROOT / spec_file).read_text())
    total, every = spec["trainer"]["total_steps"], spec.get("checkpoint", {}).get("every", 0)
    steps = sorted({*range(every, total + 1, every), total} if every else {total})
    return steps[-spec.get("checkpoint", {}).get("keep_last", 3) :]


@pytest.mark.parametrize(
    "page,spec_file",
    [
        ("README.md", "examples/grpo_tiny.yaml"),
        ("docs/guides/sft-then-grpo.md", "examples/sft_arithmetic.yaml"),
    ],
)
def test_a_pages_fork_names_a_checkpoint_its_example_keeps(page: str, spec_file: str) -> None:
    forks = re.findall(r"tandem fork \S+ --step (\d+)(?: --steps (\d+))?", (ROOT / page).read_text())
    kept = kept_checkpoints(spec_file)
    total = yaml.safe_load((ROOT / spec_file).read_text())["trainer"]["total_steps"]
    assert forks, page
    for step, steps in forks:
        assert int(step) in kept, f"{page}: fork --step {step}, but {spec_file} keeps {kept}"
        assert int(steps or total) > int(step), (
            f"{page}: a fork at {step} with {steps or total} steps trains nothing"
        )


ACTIVATE = "source .venv/bin/activate"


@pytest.mark.parametrize("page", PAGES, ids=named)
def test_a_page_activates_the_virtualenv_before_its_first_tandem(page: Path) -> None:
    """One way onto PATH for every page: `tandem` after `source .venv/bin/activate` (make install
    puts nothing on PATH by itself); a page that runs no `tandem` needs none."""
    from tests.docs_runner import page_blocks

    code = "\n".join(b.code for b in page_blocks(page) if b.kind != "python" and not b.not_run)
    first = re.search(r"^\$? ?(?:[A-Z_]+=\$\()?tandem\b", code, re.M)
    if first:
        assert ACTIVATE in code[: first.start()], f"{named(page)} runs `tandem` before `{ACTIVATE}`"
    assert not re.search(r"(?<![\w/])\.venv/bin/tandem ", code), (
        f"{named(page)}: say `tandem`, once activated"
    )


RESULTS = ROOT / "bench" / "RESULTS.md"
RATIO = re.compile(r"(?<![\w.])\d+(?:\.\d+)?(?:-\d+(?:\.\d+)?)?x\b")
FIGURE_PAGES = [*PAGES, ROOT / "docs" / "reference" / "performance.md"]


def dependencies() -> set[str]:
    """Python and the packages pyproject.toml names: a figure right after one is its version."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = [*project["dependencies"], *sum(project["optional-dependencies"].values(), [])]
    return {"python", *(re.match(r"[\w.-]+", want).group().lower() for want in wanted)}


def ratios(text: str) -> list[str]:
    """The ratios a text quotes: `0.125x`, `0.147-0.165x`, but not `Ray 2.5x` (Ray's 2.50s)."""
    known = dependencies()
    found = []
    for m in RATIO.finditer(text):
        before = re.search(r"([\w.-]+)\s+$", text[: m.start()])
        if before is None or before.group(1).lower() not in known:
            found.append(m.group())
    return found


def current_table() -> str:
    """bench/RESULTS.md's first table: the current figure for each question."""
    lines = RESULTS.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("|"))
    end = next((i for i in range(start, len(lines)) if not lines[i].startswith("|")), len(lines))
    return "\n".join(lines[start:end])


@pytest.mark.parametrize("page", FIGURE_PAGES, ids=named)
def test_a_ratio_a_page_quotes_is_in_the_current_table(page: Path) -> None:
    """Figures come from one place: a ratio on a page (0.125x, 1.82x, 0.147-0.165x) is written as
    bench/RESULTS.md's current table has it, so two pages cannot quote one question differently."""
    table = current_table()
    stray = [ratio for ratio in ratios(page.read_text()) if ratio not in table]
    assert not stray, f"{named(page)} quotes {stray}, which bench/RESULTS.md's first table does not hold"


def test_the_ratio_check_catches_the_figure_two_pages_disagreed_on() -> None:
    table = current_table()
    assert "0.125x" in table and ratios("0.145x with the exact-answer reward") == ["0.145x"]
    assert (
        "0.145x with the exact-answer reward"
        not in (ROOT / "docs" / "reference" / "performance.md").read_text()
    )


def test_a_version_is_told_from_a_ratio() -> None:
    text = "Since Ray 2.5x a cluster asks for a token; with Python 3.1x a step took 0.88x, vLLM 1.2x 2.1x"
    assert ratios(text) == ["0.88x", "2.1x"]
    assert ratios("Tandem 2.5x, a model 1.5x as large") == ["2.5x", "1.5x"]  # not a dependency's name


def test_the_quickstart_names_what_make_install_installs() -> None:
    """The extras and system packages `make install` adds, each named where the quickstart says what
    it installs: a user installing by hand, or offline, goes by that list."""
    makefile = (ROOT / "Makefile").read_text()
    extras = re.search(r"pip install -e '\.\[([\w,-]+)\$", makefile).group(1).split(",")
    packages = re.search(r'MISSING="\$\$\(([^\n]*)', makefile).group(1)
    page = (ROOT / "docs" / "quickstart.md").read_text()
    assert len(extras) > 4 and "chromium" in packages and "bubblewrap" in packages
    for name in [*extras, "chromium", "bubblewrap"]:
        assert f"`{name}`" in page, f"docs/quickstart.md does not name `{name}`, which make install installs"
