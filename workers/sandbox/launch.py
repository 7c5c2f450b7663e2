"""How a sandbox's process is started: bubblewrap's command line, the environment, the mode.

Modes (`sandbox_mode`, probed once per process): "drop" (root: bwrap, then a fresh random uid),
"userns" (a user namespace, uid 65534) or "none" (no bubblewrap, allowed by the operator). The view:
/usr, Python and the source read-only (the service home hidden), code at /code, tmpfs /scratch, /tmp.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import random
import shutil
import site
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from workers.sandbox.limits import Limits, unsandboxed_allowed

log = logging.getLogger("tandem.sandbox")
SCRATCH, CODE = "/scratch", "/code"  # paths inside the sandbox
SANDBOX_UID = 65534  # "nobody", inside a user namespace
DROP_UIDS = (200_000, 1_200_000)  # fresh uids for "drop" mode: owned by no file or process
SCRATCH_BYTES = 256 * 1024 * 1024  # each of /scratch and /tmp: tmpfs takes the host's memory
ETC = ("ld.so.cache", "ld.so.conf", "ld.so.conf.d", "localtime", "timezone", "alternatives", "ssl",
       "ca-certificates", "pki", "mime.types", "nsswitch.conf", "hosts", "host.conf", "resolv.conf")  # fmt: skip
PROBE_TIMEOUT_S = 60.0


class SandboxUnavailable(RuntimeError):
    """User code was refused: no sandbox can run here and the operator did not allow running without."""


@dataclass(frozen=True)
class Mode:
    name: str  # "drop", "userns" or "none"
    note: str  # what the start-up log says about it


def sandbox_mode(allow_unsandboxed: bool | None = None) -> Mode:
    """The mode user code runs in here; SandboxUnavailable when none may (`allow_unsandboxed` None: the
    operator's choice, limits.ENV_UNSANDBOXED)."""
    mode, why = probe()
    if mode is not None:
        return Mode(mode, f"user code runs sandboxed (bubblewrap, mode {mode})")
    allowed = unsandboxed_allowed() if allow_unsandboxed is None else allow_unsandboxed
    if allowed:
        return Mode(
            "none", f"user code runs UNSANDBOXED, as the service's user (--unsandboxed-user-code): {why}"
        )
    raise SandboxUnavailable(
        f"user code runs only in a sandbox, and none can run on this host: {why}. Install bubblewrap "
        "(apt-get install bubblewrap) with user namespaces enabled, or, if every user of this service "
        "is trusted with its files and secrets, start it with `tandem serve --unsandboxed-user-code`"
    )


@functools.cache
def probe() -> tuple[str | None, str]:
    """(the first sandbox mode that runs here, "") or (None, why none does); run once per process."""
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        return None, "bubblewrap (bwrap) is not installed"
    problems = []
    for mode in ("drop", "userns") if os.geteuid() == 0 else ("userns",):
        staging = Path(tempfile.mkdtemp(prefix="tandem-sandbox-probe-"))
        try:
            argv, env = command(mode, staging, Limits(), probe=True)
            open_staging(staging)
            done = subprocess.run(argv, env=env, stdin=subprocess.DEVNULL, capture_output=True,
                                  timeout=PROBE_TIMEOUT_S)  # fmt: skip
            if done.returncode == 0 and b"sandbox-ok" in done.stdout:
                return mode, ""
            tail = done.stderr.decode("utf-8", "replace").strip().splitlines()[-1:] or [
                f"exit code {done.returncode}"
            ]
            problems.append(f"{mode}: {tail[0][:300]}")
        except (OSError, subprocess.TimeoutExpired) as err:
            problems.append(f"{mode}: {err}")
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return None, "bubblewrap cannot start a sandbox (" + "; ".join(problems) + ")"


def command(
    mode: str, staging: Path, limits: Limits, probe: bool = False
) -> tuple[list[str], dict[str, str]]:
    """(argv, environment) of a sandbox whose staged code is in `staging`."""
    uid = random.randrange(*DROP_UIDS) if mode == "drop" else None
    config = {"uid": uid, "cpu_s": limits.cpu_s, "memory_mb": limits.memory_mb, "file_mb": limits.file_mb,
              "processes": limits.processes if mode != "none" else None}  # fmt: skip
    child = [sys.executable, "-s", "-m", "workers.sandbox", *(["--probe"] if probe else []),
             json.dumps(config)]  # fmt: skip
    if mode == "none":
        return child, _unsandboxed_env()
    return [*bwrap_args(mode, staging, limits), "--", *child], sandbox_env()


def bwrap_args(mode: str, staging: Path, limits: Limits) -> list[str]:
    args = ["bwrap", "--die-with-parent", "--new-session", "--unshare-pid", "--unshare-ipc",
            "--unshare-uts", "--unshare-cgroup-try", "--hostname", "sandbox"]  # fmt: skip
    if mode == "userns":
        args += ["--unshare-user", "--uid", str(SANDBOX_UID), "--gid", str(SANDBOX_UID), "--disable-userns"]
    if not limits.network:
        args.append("--unshare-net")
    args += ["--ro-bind", "/usr", "/usr", "--proc", "/proc", "--dev", "/dev"]
    for top in ("bin", "sbin", "lib", "lib32", "lib64", "libx32"):
        path = Path("/", top)
        if path.is_symlink():
            args += ["--symlink", os.readlink(path), str(path)]
        elif path.is_dir():
            args += ["--ro-bind", str(path), str(path)]
    args += ["--perms", "0755", "--dir", "/etc"]
    for name in ETC:
        args += ["--ro-bind-try", f"/etc/{name}", f"/etc/{name}"]
    for path in (SCRATCH, "/tmp"):  # before the binds: a PYTHONPATH folder may lie under /tmp
        args += ["--perms", "1777", "--size", str(SCRATCH_BYTES), "--tmpfs", path]
    made = {Path("/"), Path("/usr"), Path("/etc"), Path("/proc"), Path("/dev"), Path(SCRATCH), Path("/tmp")}
    bound = [Path("/usr")]
    for root in readable_roots():
        if any(root.is_relative_to(b) for b in bound):
            continue
        args += _parents(root, made) + ["--ro-bind", str(root), str(root)]
        bound.append(root)
    for hidden in hidden_paths():
        if hidden.is_dir() and any(hidden.is_relative_to(b) for b in bound):
            args += ["--tmpfs", str(hidden)]  # a folder of the service's under a bound one: empty here
    args += ["--ro-bind", str(staging), CODE]
    return args + ["--chdir", SCRATCH]


def _parents(path: Path, made: set[Path]) -> list[str]:
    """bwrap makes a bind's missing parents 0700, which an unprivileged uid cannot walk: 0755 instead."""
    args = []
    for parent in reversed(path.parents):
        if parent not in made:
            args += ["--perms", "0755", "--dir", str(parent)]
            made.add(parent)
    return args


def readable_roots() -> list[Path]:
    """What a sandbox may read besides the system: Python, the project's source and PYTHONPATH."""
    python = [Path(sys.base_prefix), Path(sys.prefix), Path(os.path.realpath(sys.executable)).parents[1]]
    paths = [*python, *map(Path, site.getsitepackages()), source_root()]
    paths += [Path(p) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    roots = []
    for path in paths:
        path = path.resolve()
        if path.is_dir() and path != Path("/") and path not in roots and not _covers_secret(path):
            roots.append(path)
    return sorted(roots, key=lambda p: len(p.parts))


def _covers_secret(path: Path) -> bool:
    """Home folders and anything in the service home are never bound (the home is hidden in a parent)."""
    homes = (Path("/root"), Path("/home"), Path.home().resolve())
    return path in homes or any(path.is_relative_to(h) for h in hidden_paths())


def source_root() -> Path:
    return Path(__file__).resolve().parents[2]


def hidden_paths() -> list[Path]:
    """The service's own folders: never visible in a sandbox, even under a folder that is."""
    home = os.environ.get("TANDEM_HOME") or Path.home() / ".tandem"
    return [Path(home).expanduser().resolve()]


def sandbox_env() -> dict[str, str]:
    """An allow-list: nothing of the service's environment (tokens, keys, TANDEM_*) crosses."""
    paths = [str(source_root())] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return {
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "LANG": "C.UTF-8",
        "LC_ALL": "C.UTF-8",
        "HOME": SCRATCH,
        "TMPDIR": "/tmp",
        "USER": "sandbox",
        "PYTHONPATH": os.pathsep.join(dict.fromkeys(paths)),
        "PYTHONDONTWRITEBYTECODE": "1",
        "PYTHONUNBUFFERED": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "HF_HUB_OFFLINE": "1",
        "OMP_NUM_THREADS": "1",
        "OPENBLAS_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
        "MALLOC_ARENA_MAX": "2",  # glibc reserves 64 MiB of address space per thread's arena otherwise
    }


def _unsandboxed_env() -> dict[str, str]:
    env = dict(os.environ)
    paths = [str(source_root()), *(p or os.getcwd() for p in sys.path)]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    return env


def open_staging(staging: Path) -> None:
    """Staged code readable by whatever uid the child runs as (it is bound read-only)."""
    for path in [staging, *staging.rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)
