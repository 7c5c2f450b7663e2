"""The offline bundle: everything Tandem needs beyond a CUDA PyTorch image, in one folder to carry.

Air-gapped GPU clusters cannot reach a package index. `make bundle` (this script) writes
`dist/offline/`: the wheels of Tandem's requirement closure for one Python version and platform,
less torch and its own closure (the image has them) and less what the target image already holds
(`--have`, names or `pip freeze` lines; default: deploy/cuda-image-packages.txt), plus Tandem's own
wheel and `install.sh`, which installs them with `pip --no-index --no-deps` into a virtualenv or a
folder. Ray's wheel goes in without its Java jar (`ray/jars/`, which Python never loads), stored
uncompressed and then xz-compressed as `<wheel>.xz`: xz over the raw files packs far tighter than
the wheel's own zip deflate. The bundle must stay under `--max-mib`; the script prints its size and
fails above it.

    python deploy/offline_bundle.py                      # the running interpreter
    python deploy/offline_bundle.py --python 3.12        # CPython 3.12, manylinux x86_64
"""

from __future__ import annotations

import argparse
import io
import json
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterable
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_HAVE = ROOT / "deploy" / "cuda-image-packages.txt"
# Extras of a dependency that Tandem never uses: ray[default] is Ray's dashboard and its metrics
# exporters (opencensus, py-spy, virtualenv, ...); Tandem starts Ray without a dashboard.
DROPPED_EXTRAS = {"ray": {"default"}}
# Always bundled at the project's version, whatever the image holds: Ray's protocol must match on
# every node, and Tandem's decode and training paths build on transformers' model classes.
OWN_VERSION = ("ray", "transformers")
PIP_TIMEOUT_S = 900


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def project_requirements(pyproject: Path) -> list[str]:
    """The project's runtime dependencies, torch left out, with the extras it does not use dropped."""
    try:
        import tomllib
    except ImportError:  # Python 3.10
        from pip._vendor import tomli as tomllib
    out = []
    for line in tomllib.loads(pyproject.read_text())["project"]["dependencies"]:
        req = Requirement(line)
        if canonical(req.name) == "torch":
            continue
        req.extras -= DROPPED_EXTRAS.get(canonical(req.name), set())
        out.append(str(req))
    return out


def platform_flags(python: str | None, platform: str) -> list[str]:
    """pip's flags for another interpreter: pip matches a manylinux tag exactly, so every older
    glibc tag the platform accepts is named too."""
    if not python:
        return []
    flags = ["--python-version", python, "--implementation", "cp"]
    found = re.fullmatch(r"manylinux_2_(\d+)_(\w+)", platform)
    if not found:
        return [*flags, "--platform", platform]
    newest, arch = int(found[1]), found[2]
    tags = [f"manylinux_2_{n}_{arch}" for n in range(newest, 4, -1)]
    tags += [f"manylinux{alias}_{arch}" for alias in ("2014", "2010", "1")]
    return flags + [f for tag in tags for f in ("--platform", tag)]


def pip(python_exe: str, *args: str) -> None:
    command = [python_exe, "-m", "pip", *args]
    try:
        subprocess.run(command, check=True, timeout=PIP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"pip {args[0]} took over {PIP_TIMEOUT_S} s: {' '.join(command)}") from None


def resolve(python_exe: str, requirements: list[str], flags: list[str], work: Path) -> dict:
    """pip's resolution of `requirements` for the target (metadata only: nothing large is fetched)."""
    report = work / "report.json"
    pip(
        python_exe, "install", "--dry-run", "--ignore-installed", "--only-binary=:all:", "-q",
        "--report", str(report), "--target", str(work / "unused"), *flags, *requirements,
    )  # fmt: skip
    return json.loads(report.read_text())


def requirement_closure(report: dict, roots: Iterable[str]) -> set[str]:
    """The names reachable from `roots` through the resolved packages' requirements."""
    metadata = {canonical(i["metadata"]["name"]): i["metadata"] for i in report["install"]}
    env = {**default_environment(), **report["environment"], "extra": ""}
    seen, todo = set(), [canonical(r) for r in roots]
    while todo:
        name = todo.pop()
        if name in seen or name not in metadata:
            continue
        seen.add(name)
        for line in metadata[name].get("requires_dist") or []:
            req = Requirement(line)
            if req.marker is None or req.marker.evaluate(env):
                todo.append(canonical(req.name))
    return seen


def read_have(path: Path | None) -> dict[str, str | None]:
    """What the target image holds: `name` or `name==version` per line (a `pip freeze` works)."""
    if path is None:
        return {}
    have = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            have[canonical(name)] = version.strip() or None
    return have


def choose(report: dict, have: dict[str, str | None]) -> dict[str, str]:
    """name -> version of what goes into the bundle."""
    resolved = {canonical(i["metadata"]["name"]): i["metadata"]["version"] for i in report["install"]}
    torch_side = requirement_closure(report, ["torch"])
    needs: dict[str, list[Requirement]] = {}  # what the bundled packages ask of each other
    env = {**default_environment(), **report["environment"], "extra": ""}
    for item in report["install"]:
        for line in item["metadata"].get("requires_dist") or []:
            req = Requirement(line)
            if req.marker is None or req.marker.evaluate(env):
                needs.setdefault(canonical(req.name), []).append(req)

    def image_serves(name: str) -> bool:
        if name not in have or name in OWN_VERSION:
            return False
        version = have[name]
        return version is None or all(
            r.specifier.contains(Version(version), True) for r in needs.get(name, [])
        )

    return {
        name: version
        for name, version in resolved.items()
        if name not in torch_side
        and not name.startswith(("nvidia-", "cuda-"))
        and name != "triton"
        and not image_serves(name)
    }


def download(python_exe: str, packages: dict[str, str], flags: list[str], dest: Path) -> None:
    pins = [f"{name}=={version}" for name, version in sorted(packages.items())]
    pip(python_exe, "download", "--no-deps", "--only-binary=:all:", "-q", "-d", str(dest), *flags, *pins)


def build_project_wheel(python_exe: str, dest: Path, work: Path) -> None:
    """Tandem's wheel, built from a copy of its sources so that the checkout gains no build/ folder."""
    source = work / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, source / name)
    for package in ("api", "service", "controller", "workers", "engines"):
        shutil.copytree(ROOT / package, source / package, ignore=shutil.ignore_patterns("__pycache__"))
    pip(python_exe, "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(dest), str(source))


def strip_jars(wheel: Path, dest: Path) -> Path:
    """`wheel` without ray/jars/, stored uncompressed (xz does the packing), its RECORD updated."""
    out = dest / wheel.name
    with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as dst:
        for info in src.infolist():
            if info.filename.startswith("ray/jars/"):
                continue
            data = src.read(info.filename)
            if re.fullmatch(r"[^/]+\.dist-info/RECORD", info.filename):  # the wheel's own, not a vendored one
                lines = data.decode().splitlines(keepends=True)
                data = "".join(line for line in lines if not line.startswith("ray/jars/")).encode()
            info.compress_type = zipfile.ZIP_STORED
            dst.writestr(info, data)
    return out


def xz(path: Path, level: int) -> Path:
    """`path` compressed to path.xz (the xz tool, all cores, when there is one) and removed."""
    target = path.with_name(path.name + ".xz")
    if shutil.which("xz"):
        with target.open("wb") as sink:
            subprocess.run(["xz", f"-{level}", "-T0", "-c", str(path)], stdout=sink, check=True)
    else:
        import lzma

        with path.open("rb") as src, lzma.open(target, "wb", preset=level) as sink:
            shutil.copyfileobj(src, sink, io.DEFAULT_BUFFER_SIZE * 256)
    path.unlink()
    return target


def build(
    out: Path, python: str | None, platform: str, have: Path | None, level: int, python_exe: str
) -> int:
    """Write the bundle into `out` (emptied first); returns its size in bytes."""
    if out.exists():
        shutil.rmtree(out)
    (out / "wheels").mkdir(parents=True)
    flags = platform_flags(python, platform)
    with tempfile.TemporaryDirectory(prefix="tandem-bundle-") as tmp:
        work = Path(tmp)
        report = resolve(python_exe, project_requirements(ROOT / "pyproject.toml"), flags, work)
        packages = choose(report, read_have(have))
        download(python_exe, packages, flags, work)
        for wheel in work.glob("*.whl"):
            if canonical(wheel.name.split("-")[0]) == "ray":
                xz(strip_jars(wheel, out), level)
            else:
                shutil.move(wheel, out / "wheels" / wheel.name)
        build_project_wheel(python_exe, out / "wheels", work)
    shutil.copy2(ROOT / "deploy" / "offline_install.sh", out / "install.sh")
    (out / "install.sh").chmod(0o755)
    return sum(f.stat().st_size for f in out.rglob("*") if f.is_file())


def python_version(text: str) -> str:
    if text and not re.fullmatch(r"3\.\d+", text):
        raise argparse.ArgumentTypeError(f"a CPython version such as 3.12, not '{text}'")
    return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=ROOT / "dist" / "offline")
    parser.add_argument(
        "--python",
        default="",
        type=python_version,
        help="target CPython version, e.g. 3.12 (default: this one)",
    )
    parser.add_argument("--platform", default="manylinux_2_28_x86_64", help="target platform with --python")
    parser.add_argument("--have", default=str(DEFAULT_HAVE), help="the image's packages; '' for none")
    parser.add_argument("--xz-level", type=int, default=9, choices=range(10), help="xz preset for Ray")
    parser.add_argument("--max-mib", type=float, default=60.0, help="fail when the bundle is larger")
    parser.add_argument("--pip-python", default=sys.executable, help="the interpreter whose pip is used")
    args = parser.parse_args(argv)
    have = Path(args.have) if args.have else None
    size = build(args.out, args.python or None, args.platform, have, args.xz_level, args.pip_python)
    files = sorted(p.relative_to(args.out) for p in args.out.rglob("*") if p.is_file())
    print("\n".join(str(f) for f in files))
    print(f"bundle {args.out}: {len(files)} files, {size / 2**20:.1f} MiB (limit {args.max_mib:g} MiB)")
    if size > args.max_mib * 2**20:
        print(f"error: the bundle is over {args.max_mib:g} MiB", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
