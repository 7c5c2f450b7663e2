"""Run a documentation page as a reader would: its shell and Python blocks in order, in one terminal's
state, against a real `tandem serve`, and compare the output a page shows with what the commands print.

Blocks are fenced ```bash, ```sh, ```console or ```python; other fences (yaml, text) are read, not run.
A marker on the line before a fence (an HTML comment, invisible on the rendered page) says why a block
is not run here; one without a reason is an error:

- `<!-- not-run: REASON -->`: it cannot run on this machine (a GPU, a cluster, an image build);
- `<!-- slow: REASON -->`: it trains for minutes; only the slow variant runs it.

The reader's terminal. Each page starts a fresh shell: HOME is the run's home folder (so `~/.tandem`
is its service's home), PATH is the test's PATH without the virtualenv (a terminal before
`source .venv/bin/activate`), no TANDEM_* variable is set, and the folder is the checkout. Shell
blocks run one after the other in that shell's state (variables, functions and the current folder
carry over, as in one terminal) under `set -e -o pipefail`: a failed command fails its block, where a
reader would stop too. Python blocks run in one interpreter per page (the `python3` on the shell's
PATH, in its environment), sharing their names, as pasted into one session.

What the runner changes in a block's text, and nothing else:
- `.venv/` is the virtualenv the reader installed (the checkout's `.venv` after `make install`:
  here, the one running the tests, or a wheel's);
- `http://127.0.0.1:8000` is the runner's service (on a free port: 8000 may be another's);
- a line `tandem serve ... &` is the runner's service, started the same way (`tandem serve` on the
  home) before the first page: one home has one service, so the line is not run a second time.

Output. In a console block, `$ COMMAND` lines (a trailing backslash continues one) are run, and the
lines up to the next command are the output the page shows: stdout and stderr as a terminal shows
them (a progress bar in its last state). A shown output is compared after this normalisation: runs
of blanks are one blank and blank lines are dropped; an id (`job-`/`file-` + hex, `tml-...`) matches
any id of its kind; a number (a figure, a time, a date, a size) matches any number; `...` matches
anything within a line, and a line of `...` any lines. A console command whose output matches may
fail (a page showing an error); one without shown output must succeed.
"""

from __future__ import annotations

import json
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from tests.serve_util import cluster_env, free_ports, kill_leftovers, stop, wait_ready

REPO = Path(__file__).resolve().parents[1]
FENCE = re.compile(
    r"^(?P<indent>[ \t]*)```(?P<lang>[\w-]*)[^\n]*\n(?P<body>.*?)^(?P=indent)```[ \t]*$", re.M | re.S
)
MARKER = re.compile(r"<!--\s*(?P<kind>not-run|slow)\b\s*:?(?P<reason>.*?)-->", re.S)
KINDS = {"bash": "shell", "sh": "shell", "console": "console", "python": "python"}
BLOCK_TIMEOUT_S = 300
SLOW_BLOCK_TIMEOUT_S = 1800  # a `slow:` block trains for minutes, on a loaded machine for many
DEFAULT_URL = "http://127.0.0.1:8000"
SERVE_LINE = re.compile(r"^\s*tandem serve\b[^#\n]*&\s*(#.*)?$", re.M)
VENV_PATH = re.compile(r"(?<![\w/.])\.venv/")
TERMINAL = {"succeeded", "failed", "cancelled", "paused"}


class PageError(AssertionError):
    """A page is malformed (a marker without a reason) or one of its blocks failed."""


@dataclass
class Block:
    page: str
    number: int
    line: int
    kind: str  # shell, console, python
    code: str
    not_run: str | None = None
    slow: str | None = None

    @property
    def name(self) -> str:
        return f"{self.page} block {self.number} (line {self.line})"


def page_blocks(path: Path) -> list[Block]:
    """The page's runnable blocks in order, each with its marker's reason; a marker without one raises."""
    text, page = path.read_text(), _named(path)
    blocks = []
    for found in FENCE.finditer(text):
        kind = KINDS.get(found["lang"])
        if kind is None:
            continue
        line = text.count("\n", 0, found.start()) + 1
        before = text[: found.start()].rstrip().rsplit("\n", 1)[-1].strip()
        marker = MARKER.fullmatch(before)
        reasons = {"not-run": None, "slow": None}
        if marker:
            if not marker["reason"].strip():
                raise PageError(f"{page} line {line - 1}: a `{marker['kind']}` marker must say why")
            reasons[marker["kind"]] = " ".join(marker["reason"].split())
        indent = len(found["indent"])
        code = "\n".join(row[indent:] for row in found["body"].splitlines())
        blocks.append(Block(page, len(blocks) + 1, line, kind, code, reasons["not-run"], reasons["slow"]))
    return blocks


def _named(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(REPO))
    except ValueError:
        return path.name


# ---- output -------------------------------------------------------------------------------------

ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
TOKEN = re.compile(
    r"(?P<id>\b(?:job|file)-[0-9a-f]{4,}\b|\btml-\S+)|(?P<number>-?\d+(?:\.\d+)?(?:e[-+]?\d+)?)|(?P<any>\.\.\.|…)"
)


def shown_lines(output: str) -> list[str]:
    """What a terminal shows: the last state of a line redrawn with \\r, blanks collapsed, no blank lines."""
    lines = []
    for raw in ANSI.sub("", output).split("\n"):
        line = " ".join(raw.rstrip("\r").rsplit("\r", 1)[-1].split())
        if line:
            lines.append(line)
    return lines


def line_pattern(expected: str) -> str:
    pattern, at = [], 0
    for token in TOKEN.finditer(expected):
        pattern.append(re.escape(expected[at : token.start()]))
        if token["id"]:
            prefix = token["id"].split("-", 1)[0]
            pattern.append(rf"{prefix}-\S+")
        elif token["number"]:
            pattern.append(r"-?\d+(?:\.\d+)?(?:e[-+]?\d+)?")
        else:
            pattern.append(".*")
        at = token.end()
    return "".join(pattern) + re.escape(expected[at:])


def output_matches(expected: str, actual: str) -> bool:
    """Whether `actual` is what a page shows as `expected`, after the normalisation above."""
    parts = []
    for line in shown_lines(expected):
        parts.append(r"(?:[^\n]*\n)*?" if line in ("...", "…") else line_pattern(line) + r"\n")
    return re.fullmatch("".join(parts), "".join(f"{line}\n" for line in shown_lines(actual))) is not None


def console_commands(code: str) -> list[tuple[str, str]]:
    """A console block's (command, shown output) pairs."""
    pairs: list[tuple[str, list[str]]] = []
    continuing = False
    for line in code.splitlines():
        if continuing:
            pairs[-1][0].append(line)
        elif line.startswith("$ "):
            pairs.append(([line[2:]], []))
        elif pairs:
            pairs[-1][1].append(line)
        else:
            raise PageError(f"a console block's first line must be a `$ ` command: {line!r}")
        continuing = line.endswith("\\") and not pairs[-1][1]
    return [("\n".join(command), "\n".join(shown)) for command, shown in pairs]


# ---- the reader's machine -----------------------------------------------------------------------


@dataclass
class Machine:
    """A fresh home with `tandem serve` running on it, and the reader's environment before a page."""

    work: Path
    home: Path
    venv: Path
    cwd: Path
    url: str
    env: dict[str, str]
    service: subprocess.Popen
    log: Path
    ray_tmp: Path

    def admin(self) -> httpx.Client:
        token = (self.home / ".tandem" / "admin_token").read_text().strip()
        return httpx.Client(base_url=self.url, headers={"Authorization": f"Bearer {token}"}, timeout=30)

    def stop(self) -> None:
        stop(self.service, 120)
        kill_leftovers(str(self.ray_tmp))
        shutil.rmtree(self.ray_tmp, ignore_errors=True)

    def settle_jobs(self, timeout_s: float = 90) -> None:
        """Cancel what a page left running (a reader's Ctrl-C), so the next page has the CPUs."""
        with self.admin() as api:
            live = [j["id"] for j in api.get("/v1/jobs", params={"limit": 100}).json()["data"]
                    if j["status"] not in TERMINAL]  # fmt: skip
            for job_id in live:
                api.post(f"/v1/jobs/{job_id}/cancel")
            deadline = time.monotonic() + timeout_s
            while live and time.monotonic() < deadline:
                live = [i for i in live if api.get(f"/v1/jobs/{i}").json()["status"] not in TERMINAL]
                time.sleep(0.5)


def start_machine(work: Path, venv: Path, cwd: Path = REPO, source_tree: bool = True) -> Machine:
    """`tandem serve` of `venv` on a fresh home under `work`, as a reader starts it after installing.
    `source_tree`: the code is the checkout's (PYTHONPATH, for a worktree beside the venv's checkout)."""
    home = work / "home"
    home.mkdir(parents=True)
    ray_tmp = Path(tempfile.mkdtemp(prefix="docs-ray-"))  # short: Ray's socket paths must fit 107 bytes
    env = cluster_env(str(ray_tmp))
    if not source_tree:
        env.pop("PYTHONPATH", None)
    for name in [n for n in env if n.startswith("TANDEM_")]:  # a reader sets none (a warm controller too)
        env.pop(name)
    env.pop("VIRTUAL_ENV", None)
    hidden = {str(venv / "bin"), str(Path(sys.executable).parent)}
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep) if p not in hidden)
    env["HOME"] = str(home)
    (port,) = free_ports(1)
    log = work / "service.log"
    with log.open("w") as out:
        service = subprocess.Popen([str(venv / "bin" / "tandem"), "serve"], env={**env, "TANDEM_PORT": str(port)},
                                   cwd=cwd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    wait_ready(service, url, log, 180)
    return Machine(work, home, venv, cwd, url, env, service, log, ray_tmp)


# ---- one page's terminal ------------------------------------------------------------------------

SHELL_PRELUDE = """\
[ -f {state} ] && source {state} >/dev/null 2>&1
cd "$(cat {cwd})"
__docs_save() {{ __rc=$?; {{ declare -p; declare -f; }} > {state}.new 2>/dev/null; mv {state}.new {state}; pwd > {cwd}; exit $__rc; }}
trap __docs_save EXIT
set -e -o pipefail
"""


@dataclass
class Ran:
    rc: int
    output: str


@dataclass
class Reader:
    """One page's terminal on `machine`: the shell state between blocks, and one Python interpreter."""

    machine: Machine
    folder: Path
    python: subprocess.Popen | None = None
    count: int = field(default=0)

    def __post_init__(self) -> None:
        self.folder.mkdir(parents=True)
        (self.folder / "cwd").write_text(str(self.machine.cwd))

    def as_run(self, code: str) -> str:
        """The block's text with the reader's machine in it (the three changes the module names)."""
        code = SERVE_LINE.sub(": the service runs already, started by the runner as tandem serve", code)
        code = code.replace(DEFAULT_URL, self.machine.url)
        return VENV_PATH.sub(str(self.machine.venv) + "/", code)

    def shell(self, code: str, timeout_s: float = BLOCK_TIMEOUT_S) -> Ran:
        self.count += 1
        script = self.folder / f"block{self.count}.sh"
        out = self.folder / f"block{self.count}.out"
        prelude = SHELL_PRELUDE.format(state=self.folder / "state", cwd=self.folder / "cwd")
        script.write_text(prelude + self.as_run(code) + "\n")
        with out.open("w") as sink:  # a file, not a pipe: a background command keeps it open
            proc = subprocess.Popen(["bash", str(script)], env=self.machine.env, cwd=self.machine.cwd,
                                    stdin=subprocess.DEVNULL, stdout=sink, stderr=subprocess.STDOUT,
                                    start_new_session=True)  # fmt: skip
            try:
                rc = proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)
                return Ran(124, _read(out) + f"\n[the block ran past {timeout_s:.0f} s]")
        return Ran(rc, _read(out))

    def environment(self) -> dict[str, str]:
        """The shell's exported variables now (what a program started from it gets)."""
        dump = self.folder / "env"
        ran = self.shell(f"env -0 > {dump}", timeout_s=30)
        assert ran.rc == 0, ran.output
        return dict(item.split("=", 1) for item in dump.read_text().split("\0") if "=" in item)

    def run_python(self, code: str, name: str, timeout_s: float = BLOCK_TIMEOUT_S) -> Ran:
        if self.python is None:
            env = self.environment()
            python = shutil.which("python3", path=env.get("PATH")) or "python3"
            cwd = (self.folder / "cwd").read_text().strip()
            self.python = subprocess.Popen([python, "-u", "-c", PYTHON_DRIVER], env=env, cwd=cwd,
                                           stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                           start_new_session=True)  # fmt: skip
        self.count += 1
        out = self.folder / f"block{self.count}.out"
        self.python.stdin.write(json.dumps({"code": self.as_run(code), "name": name, "out": str(out)}) + "\n")
        self.python.stdin.flush()
        ready, _, _ = select.select([self.python.stdout], [], [], timeout_s)
        reply = self.python.stdout.readline() if ready else ""
        text = _read(out) if out.exists() else ""
        if not reply:
            self.close()
            return Ran(124, text + f"\n[the block ran past {timeout_s:.0f} s, or the interpreter died]")
        return Ran(0 if json.loads(reply)["ok"] else 1, text)

    def close(self) -> None:
        if self.python is not None:
            if self.python.poll() is None:
                os.killpg(self.python.pid, signal.SIGKILL)
            self.python.wait(10)
            self.python = None


PYTHON_DRIVER = """
import contextlib, json, sys, traceback
names = {"__name__": "__main__"}
for line in sys.stdin:
    request = json.loads(line)
    with open(request["out"], "w") as out, contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        try:
            exec(compile(request["code"], request["name"], "exec"), names)
            ok = True
        except BaseException:
            traceback.print_exc()
            ok = False
    sys.__stdout__.write(json.dumps({"ok": ok}) + "\\n")
    sys.__stdout__.flush()
"""


def _read(path: Path) -> str:
    """A block's output as written: newline="" keeps a progress bar's carriage returns."""
    with path.open(errors="replace", newline="") as f:
        return f.read()


# ---- a page -------------------------------------------------------------------------------------


def run_page(machine: Machine, path: Path, slow: bool = False) -> list[str]:
    """Run the page's blocks in order as a reader; raise naming the first block that fails. Returns
    the skipped blocks, each with its reason."""
    skipped = []
    reader = Reader(
        machine, machine.work / "pages" / re.sub(r"\W", "_", _named(path)) / f"run{time.time_ns()}"
    )
    try:
        for block in page_blocks(path):
            reason = block.not_run or (None if slow else block.slow and f"slow: {block.slow}")
            if reason:
                skipped.append(f"{block.name}: {reason}")
                continue
            began = time.monotonic()
            run_block(reader, block)
            print(f"{block.name}: {time.monotonic() - began:.1f} s")  # where a page's time goes
    finally:
        reader.close()
        machine.settle_jobs()
    return skipped


def run_block(reader: Reader, block: Block) -> None:
    timeout_s = SLOW_BLOCK_TIMEOUT_S if block.slow else BLOCK_TIMEOUT_S
    if block.kind == "python":
        ran = reader.run_python(block.code, block.name, timeout_s)
        _check(ran.rc == 0, block, block.code, ran)
        return
    if block.kind == "shell":
        ran = reader.shell(block.code, timeout_s)
        _check(ran.rc == 0, block, block.code, ran)
        return
    for command, shown in console_commands(block.code):
        ran = reader.shell(command, timeout_s)
        if shown.strip():
            _check(output_matches(shown, ran.output), block, command, ran, f"the page shows:\n{shown}\n")
        else:
            _check(ran.rc == 0, block, command, ran)


def _check(ok: bool, block: Block, command: str, ran: Ran, shown: str = "") -> None:
    if not ok:
        raise PageError(
            f"{block.name} failed (exit code {ran.rc}):\n{command}\n{shown}--- it printed:\n{ran.output[-6000:]}"
        )
