"""The offline bundle (deploy/offline_bundle.py, `make bundle`): built for the running interpreter from
PyPI (pip's cache reused), installed with no index into an empty folder, and run from there."""

from __future__ import annotations

import lzma
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from deploy.offline_bundle import choose, platform_flags

ROOT = Path(__file__).resolve().parents[1]
LIMIT_MIB = 64  # what a GPU session carries (the device tool's limit); `make bundle` packs Ray smaller still


def run(command: list[str], timeout: float, **kw) -> subprocess.CompletedProcess:
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, **kw)
    assert done.returncode == 0, (
        f"{command[:3]} failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    )
    return done


@pytest.fixture(scope="module")
def bundle(tmp_path_factory) -> tuple[Path, str]:
    """The bundle at xz level 0 (the lightest: `make bundle` packs at 9), and the build's output."""
    out = tmp_path_factory.mktemp("offline") / "bundle"
    script = str(ROOT / "deploy" / "offline_bundle.py")
    done = run([sys.executable, script, "--out", str(out), "--xz-level", "0", "--max-mib", str(LIMIT_MIB)],
               timeout=600)  # fmt: skip
    return out, done.stdout


@pytest.fixture(scope="module")
def installed(bundle, tmp_path_factory) -> tuple[Path, str]:
    target = tmp_path_factory.mktemp("offline-target") / "site"
    env = {**os.environ, "PYTHON": sys.executable, "PIP_NO_COMPILE": "1"}
    done = run(["sh", str(bundle[0] / "install.sh"), "--target", str(target)], timeout=600, env=env)
    return target, done.stdout


def test_the_bundle_fits_and_holds_ray_without_its_jar_and_no_torch(bundle):
    out, printed = bundle
    size = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    assert size <= LIMIT_MIB * 2**20, f"{size / 2**20:.1f} MiB"
    assert f"{size / 2**20:.1f} MiB" in printed
    [ray] = out.glob("ray-*.whl.xz")
    wheels = {p.name.split("-")[0].lower() for p in (out / "wheels").glob("*.whl")}
    assert {"tandem_rl", "transformers", "pydantic", "fastapi", "tensordict"} <= wheels
    assert not {"torch", "triton", "ray"} & wheels and not any(w.startswith("nvidia") for w in wheels)
    assert (out / "install.sh").stat().st_mode & 0o111


def test_install_sh_installs_offline_and_tandem_and_ray_run_from_the_target(bundle, installed):
    target, printed = installed
    assert "ray 2.60.0" in printed and "tandem_rl 0.1.0" in printed
    assert not (target / "ray" / "jars").exists()
    record = next(target.glob("ray-*.dist-info")) / "RECORD"
    assert "ray/jars/" not in record.read_text()
    env = {**os.environ, "PYTHONPATH": str(target)}
    # Run from elsewhere, so that the checkout's own packages are not the ones found.
    where = run(
        [sys.executable, "-c", "import api.cli, controller, ray; print(api.cli.__file__); print(ray.__file__)"],
        timeout=120, env=env, cwd=target.parent,
    ).stdout.split()  # fmt: skip
    assert all(Path(p).is_relative_to(target) for p in where), where
    helped = run([str(target / "bin" / "tandem"), "--help"], timeout=120, env=env, cwd=target.parent)
    assert "serve" in helped.stdout and "submit" in helped.stdout


def test_the_image_keeps_its_packages_unless_a_bundled_one_needs_another_version():
    def item(name: str, version: str, *requires: str) -> dict:
        return {"metadata": {"name": name, "version": version, "requires_dist": list(requires)}}

    report = {
        "environment": {"python_version": "3.12", "sys_platform": "linux"},
        "install": [
            item("torch", "2.13.0", "sympy>=1.13", "nvidia-nccl-cu13; sys_platform == 'linux'"),
            item("sympy", "1.14.0"),
            item("nvidia-nccl-cu13", "2.29.7"),
            item("transformers", "5.19.0", "tokenizers<0.24,>=0.23.1", "numpy>=1.17"),
            item("tokenizers", "0.23.3"),
            item("numpy", "2.3.5"),
            item("ray", "2.60.0"),
            item("pydantic", "2.14.3"),
        ],
    }
    # The image's numpy satisfies every bundled need; its tokenizers does not; ray and transformers
    # always go in at the project's version; torch's own closure never does.
    have = {"numpy": "2.5.2", "tokenizers": "0.22.0", "ray": None, "transformers": "5.17.0"}
    assert choose(report, have) == {
        "transformers": "5.19.0", "tokenizers": "0.23.3", "ray": "2.60.0", "pydantic": "2.14.3",
    }  # fmt: skip


def test_another_python_names_every_older_manylinux_tag():
    flags = platform_flags("3.12", "manylinux_2_28_x86_64")
    platforms = [flags[i + 1] for i, f in enumerate(flags) if f == "--platform"]
    assert flags[:4] == ["--python-version", "3.12", "--implementation", "cp"]
    assert platforms[0] == "manylinux_2_28_x86_64" and "manylinux_2_17_x86_64" in platforms
    assert "manylinux2014_x86_64" in platforms and "manylinux_2_29_x86_64" not in platforms
    assert platform_flags(None, "manylinux_2_28_x86_64") == []


def test_the_packed_wheel_of_ray_records_exactly_its_files(bundle, tmp_path):
    [packed] = bundle[0].glob("ray-*.whl.xz")
    unpacked = tmp_path / "ray.whl"
    with lzma.open(packed) as raw, unpacked.open("wb") as sink:
        shutil.copyfileobj(raw, sink)
    with zipfile.ZipFile(unpacked) as wheel:
        names = set(wheel.namelist())
        record = wheel.read(
            next(n for n in names if re.fullmatch(r"ray-[^/]+\.dist-info/RECORD", n))
        ).decode()
    listed = {line.split(",", 1)[0] for line in record.splitlines() if line}
    assert listed == names and not any(n.startswith("ray/jars/") for n in names)
