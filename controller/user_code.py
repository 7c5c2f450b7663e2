"""User code (reward functions, environments) runs in a child process, never in the caller's.

Importing a user's module runs arbitrary code: it may raise SystemExit, call os._exit, sleep
forever, or print megabytes. The API process must survive all of that, so it never imports user
code itself: `run_isolated` calls a function by import path in a fresh Python process with a time
limit and gets back plain JSON, and `check_callable_in_subprocess` uses it to check a reference
("module:name", "path/file.py:name", resolved by workers/references.py) the way the job will load it.

Each kind of user code names the in-process checker the child runs (`CHECKERS`): a function that
takes the reference string and raises ValueError saying what is wrong. Add a kind there.

The child gets the caller's import path (PYTHONPATH) and working folder, so a reference resolves in
it as it would here; its stdout is discarded and the tail of its stderr is kept for the message.
"""

from __future__ import annotations

import importlib
import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

# kind -> (checker "module:function", what to call it in messages)
CHECKERS: dict[str, tuple[str, str]] = {
    "reward": ("controller.rewards:load_reward_fn", "reward function"),
    "environment": ("workers.environments.loader:load_environment_class", "environment"),
    "agent": ("controller.external_spec:load_agent_fn", "agent"),
}
DEFAULT_TIMEOUT_S = 30.0
STDERR_TAIL = 600


class UserCodeError(ValueError):
    """User code that failed, hung or ended its process; the message says which and why."""


def check_callable_in_subprocess(ref: str, kind: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> str | None:
    """Why `ref` is not a usable `kind` (checked in a child process), or None when it is."""
    if kind not in CHECKERS:
        raise KeyError(f"unknown kind of user code {kind!r}; known: {sorted(CHECKERS)}")
    try:
        run_isolated(
            "controller.user_code:check_here", [kind, ref], timeout_s, f"{CHECKERS[kind][1]} '{ref}'"
        )
    except UserCodeError as err:
        return str(err)
    return None


def check_here(kind: str, ref: str) -> bool:
    """Run `kind`'s checker on `ref` in this process (the child's side of the check)."""
    _resolve(CHECKERS[kind][0])(ref)
    return True


def run_isolated(target: str, args: list[Any], timeout_s: float, what: str) -> Any:
    """`target(*args)` ("module:function") in a fresh Python process; its JSON result, or UserCodeError."""
    with tempfile.TemporaryDirectory(prefix="tandem-user-code-") as tmp:
        call, result, stderr = Path(tmp, "call.json"), Path(tmp, "result.json"), Path(tmp, "stderr")
        call.write_text(json.dumps({"target": target, "args": args, "what": what}))
        with stderr.open("wb") as err:
            child = subprocess.Popen(
                [sys.executable, "-m", "controller.user_code", str(call), str(result)],
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err, env=_child_env(),
                start_new_session=True,  # its own process group: a timeout ends whatever it started
            )  # fmt: skip
            try:
                child.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                _kill_group(child)
                raise UserCodeError(f"{what} did not finish within {timeout_s:g} s") from None
            finally:
                _kill_group(child)  # anything it left running in its group
        try:
            out = json.loads(result.read_text())
        except (OSError, ValueError):
            tail = _tail(stderr)
            raise UserCodeError(
                f"{what} ended the checking process (exit code {child.returncode}) before it finished"
                + (f": {tail}" if tail else "")
            ) from None
    if "error" in out:
        raise UserCodeError(out["error"])
    return out["value"]


def _child_env() -> dict[str, str]:
    env = dict(os.environ)
    paths = [p or os.getcwd() for p in sys.path]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    return env


def _kill_group(child: subprocess.Popen) -> None:
    try:
        os.killpg(child.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    child.wait()


def _tail(path: Path) -> str:
    data = path.read_bytes()[-STDERR_TAIL:]
    return data.decode("utf-8", "replace").strip().replace("\n", " | ")


def _resolve(target: str) -> Any:
    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)


def _describe(exc: BaseException, what: str) -> str:
    if isinstance(exc, ValueError):  # the checker's own message, which names the reference
        return str(exc)
    detail = f"{type(exc).__name__}({exc})" if str(exc) else type(exc).__name__
    return f"{what} could not be used: running it raised {detail}"


def _child_main(call_path: str, result_path: str) -> None:
    call = json.loads(Path(call_path).read_text())
    sys.argv = [sys.argv[0]]  # user code that parses arguments must not see (or act on) these paths
    try:
        out = {"value": _resolve(call["target"])(*call["args"])}
    except BaseException as exc:  # SystemExit and KeyboardInterrupt too: report them, do not die
        out = {"error": _describe(exc, call["what"])}
    try:
        text = json.dumps(out)
    except (TypeError, ValueError) as exc:
        text = json.dumps({"error": f"{call['what']} returned a value that is not JSON: {exc}"})
    Path(result_path).write_text(text)
    sys.stdout.flush()
    os._exit(0)  # skip atexit handlers and non-daemon threads the user code may have left


if __name__ == "__main__":
    _child_main(sys.argv[1], sys.argv[2])
