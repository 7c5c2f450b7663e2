"""Tandem installed from a wheel, outside the source tree: the examples ship with it, so a service's
default readable folder (api/settings.py) exists and the guides' specs are there to submit."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

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


def test_a_wheel_installed_elsewhere_reads_its_own_examples(tmp_path):
    source = tmp_path / "source"  # a copy: building writes build/ and *.egg-info beside the sources
    shutil.copytree(REPO, source, ignore=shutil.ignore_patterns(".git", ".venv", "__pycache__", "site",
                                                                "build", "*.egg-info", "tests", "bench"))  # fmt: skip
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    built = subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp_path / "wheels"),
                            str(source)], capture_output=True, text=True, timeout=300)  # fmt: skip
    assert built.returncode == 0, built.stderr
    target = tmp_path / "site"
    wheel = next((tmp_path / "wheels").glob("*.whl"))
    installed = subprocess.run([*pip, "install", "--no-deps", "--target", str(target), str(wheel)],
                               capture_output=True, text=True, timeout=300)  # fmt: skip
    assert installed.returncode == 0, installed.stderr
    shutil.rmtree(source)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    probe = subprocess.run([sys.executable, "-I", "-c", f"import sys; sys.path.insert(0, {str(target)!r})\n" + PROBE],
                           cwd=elsewhere, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert probe.returncode == 0, probe.stderr
    package, root, reward = probe.stdout.splitlines()
    assert Path(package) == target.resolve() and Path(root) == target.resolve() / "examples"
    assert (Path(root) / "grpo_tiny.yaml").is_file() and (Path(root) / "walkthrough.sh").is_file()
    assert reward == f"{Path(root) / 'my_reward.py'}:score"
