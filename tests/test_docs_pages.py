"""The user's pages against the code they describe, without a service: code shown as a file's is that
file's, every curl that sends JSON says so, every variable a block uses is set on the page before it,
and a fork's `--step` names a checkpoint the example it forks keeps."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
# agents.md is documented and tested with the OpenAI endpoint's own suite.
PAGES = [
    ROOT / "README.md",
    *sorted((ROOT / "docs").glob("*.md")),
    *sorted((ROOT / "docs" / "guides").glob("*.md")),
]
PAGES = [p for p in PAGES if p.name not in ("agents.md", "ARCHITECTURE.md")]
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
