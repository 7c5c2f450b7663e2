"""The documentation: the site builds strictly (a broken link, an anchor that is not there or a page
left out of the nav fails), loads nothing from the network, its generated reference pages are
current, and the README's and RESULTS.md's links lead somewhere."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import typing
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def load_generator():
    spec = importlib.util.spec_from_file_location("gen_reference", ROOT / "docs" / "gen_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def github_anchors(markdown: Path) -> set[str]:
    """The anchors GitHub gives a file's headings: lower case, punctuation dropped, spaces to '-'."""
    anchors = set()
    for line in markdown.read_text().splitlines():
        if line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            anchors.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return anchors


@pytest.mark.parametrize("page", ["config", "api"])
def test_the_generated_reference_pages_are_current(page: str) -> None:
    gen = load_generator()
    path, render = {"config": (gen.CONFIG_PAGE, gen.config_page), "api": (gen.API_PAGE, gen.api_page)}[page]
    assert path.read_text() == render(), (
        f"{path.relative_to(ROOT)} is stale: run python docs/gen_reference.py"
    )


def field_paths(model: type, prefix: str = "") -> list[str]:
    """Every field of a pydantic model, dotted: sections are walked into, and an optional section
    (`model.lora`, null unless given) is a field whose own fields follow."""
    from pydantic import BaseModel

    paths = []
    for name, field in model.model_fields.items():
        optional = type(None) in typing.get_args(field.annotation)
        kinds = [k for k in typing.get_args(field.annotation) if k is not type(None)] if optional else []
        if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
            paths += field_paths(field.annotation, f"{prefix}{name}.")
            continue
        paths.append(f"{prefix}{name}")
        if len(kinds) == 1 and isinstance(kinds[0], type) and issubclass(kinds[0], BaseModel):
            paths += field_paths(kinds[0], f"{prefix}{name}.")
    return paths


def test_the_config_reference_lists_every_jobspec_field_with_its_bounds() -> None:
    from schema.job import JobSpec

    text = (ROOT / "docs" / "reference" / "config.md").read_text()
    paths = field_paths(JobSpec)
    assert len(paths) > 80 and "algorithm.overlong.penalty_factor" in paths
    assert {"model.lora.alpha", "rollout.external.group_size", "resources.rollout.workers"} <= set(paths)
    for path in paths:
        assert f"| `{path}` |" in text, path
    undescribed = [
        row.split("|")[1].strip()
        for row in text.splitlines()
        if row.startswith("| `") and row.endswith("|  |")
    ]
    assert not undescribed, f"fields without a description= in their Field(): {undescribed}"
    assert "| `trainer.total_steps` | integer | `20` | > 0, <= 100000000 |" in text
    assert (
        "| `rollout.n` | integer | `8` | >= 1, <= 4096 | samples per prompt (the GRPO group size) |" in text
    )


def test_the_site_builds_strictly_and_loads_nothing_from_the_network(tmp_path: Path) -> None:
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    built = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path)],
                           cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert built.returncode == 0, built.stdout + built.stderr
    pages = list(tmp_path.rglob("*.html"))
    assert len(pages) >= 15 and (tmp_path / "reference" / "config.html").exists()
    for page in pages:  # scripts, styles, fonts and images all come with the site
        html = page.read_text()
        assert not re.search(r'(src|srcset)="https?://', html), page
        assert not re.search(r'<link[^>]+href="https?://', html), page
        assert "fonts.googleapis" not in html and "fonts.gstatic" not in html, page


@pytest.mark.parametrize("markdown", ["README.md", "bench/RESULTS.md"])
def test_every_relative_link_and_anchor_resolves(markdown: str) -> None:
    source = ROOT / markdown
    for target in LINK.findall(source.read_text()):
        if target.startswith(("http://", "https://", "mailto:")):
            continue
        path, _, anchor = target.partition("#")
        file = (source.parent / path).resolve() if path else source
        assert file.exists(), f"{markdown}: {target}"
        if anchor and file.suffix == ".md":
            assert anchor in github_anchors(file), f"{markdown}: no heading for #{anchor} in {file.name}"
