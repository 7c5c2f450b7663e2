"""Tandem installed from a wheel, outside the source tree: the examples ship with it, so a service's
default readable folder (api/settings.py) exists and the guides' specs are there to submit; and, in
a virtualenv of its own, the quickstart's commands run as the page has them (slow: a service and a job)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from tests.docs_runner import run_page, start_machine

REPO = Path(__file__).resolve().parents[1]
PIP = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]

PROBE = """
from pathlib import Path
import api.settings
from api.cli_spec import build_spec
from api.settings import ServeSettings

root = ServeSettings().shared_roots()[0]
print(Path(api.settings.__file__).resolve().parents[1])
print(root)
given, spec = build_spec(str(root / "custom_reward.yaml"))
print(spec.reward.function)
"""


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """Tandem's wheel, built from a copy of the checkout (building writes build/ and *.egg-info)."""
    work = tmp_path_factory.mktemp("wheel")
    source = work / "source"
    shutil.copytree(REPO, source, ignore=shutil.ignore_patterns(".git", ".venv", "__pycache__", "site",
                                                                "build", "*.egg-info", "tests", "bench"))  # fmt: skip
    built = subprocess.run([*PIP, "wheel", "--no-deps", "--no-build-isolation", "-w", str(work / "wheels"),
                            str(source)], capture_output=True, text=True, timeout=300)  # fmt: skip
    assert built.returncode == 0, built.stderr
    shutil.rmtree(source)
    return next((work / "wheels").glob("*.whl"))


def test_a_wheel_installed_elsewhere_reads_its_own_examples(wheel: Path, tmp_path: Path) -> None:
    target = tmp_path / "site"
    installed = subprocess.run([*PIP, "install", "--no-deps", "--target", str(target), str(wheel)],
                               capture_output=True, text=True, timeout=300)  # fmt: skip
    assert installed.returncode == 0, installed.stderr
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    probe = subprocess.run([sys.executable, "-I", "-c", f"import sys; sys.path.insert(0, {str(target)!r})\n" + PROBE],
                           cwd=elsewhere, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert probe.returncode == 0, probe.stderr
    package, root, reward = probe.stdout.splitlines()
    assert Path(package) == target.resolve() and Path(root) == target.resolve() / "examples"
    assert (Path(root) / "grpo_tiny.yaml").is_file() and (Path(root) / "walkthrough.sh").is_file()
    assert reward == f"{Path(root) / 'my_reward.py'}:score"


def wheel_venv(wheel: Path, venv: Path) -> Path:
    """A virtualenv holding the wheel, its `tandem` script and its examples; the requirements are the
    test environment's (a .pth line: pip would download them), never the checkout's code."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    site = Path(subprocess.run([str(venv / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                               capture_output=True, text=True, check=True, timeout=60).stdout.strip())  # fmt: skip
    (site / "requirements.pth").write_text(sysconfig.get_path("purelib") + "\n")
    installed = subprocess.run([*PIP, "--python", str(venv / "bin" / "python"), "install", "--no-deps", str(wheel)],
                               capture_output=True, text=True, timeout=300)  # fmt: skip
    assert installed.returncode == 0, installed.stderr
    return site


@pytest.mark.slow
def test_the_quickstart_runs_from_a_wheel_outside_the_source_tree(wheel: Path, tmp_path: Path) -> None:
    """docs/quickstart.md's commands, `.venv` being the wheel's virtualenv and the folder the one its
    examples/ were installed in: `tandem serve`, a job followed to its end, `tandem list`, flags."""
    venv = tmp_path / "venv"
    site = wheel_venv(wheel, venv)
    assert (site / "examples" / "grpo_tiny.yaml").is_file() and not (
        site / "api" / "__init__.py"
    ).is_symlink()
    machine = start_machine(tmp_path / "reader", venv, cwd=site, source_tree=False)
    try:
        skipped = run_page(machine, REPO / "docs" / "quickstart.md")
        served = machine.log.read_text()
    finally:
        machine.stop()
    assert len(skipped) == 1 and "clones and installs" in skipped[0], skipped  # every other block ran
    assert f"job store: {machine.home}" in served
    imported = subprocess.run([str(venv / "bin" / "python"), "-c", "import api; print(api.__file__)"], cwd=tmp_path,
                              capture_output=True, text=True, timeout=60)  # fmt: skip
    assert Path(imported.stdout.strip()).is_relative_to(site), (
        imported
    )  # the wheel's code, not the checkout's
