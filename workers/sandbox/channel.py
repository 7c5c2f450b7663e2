"""The parent's side of a sandbox: start it, call functions in it (concurrently), answer what it asks.

A call past its limit ends the process (`kill_on_timeout`) and raises SandboxTimeout; a process that
ends raises SandboxCrashed in every waiting call, and stays ended (`alive`); an exception inside raises
SandboxError with its type and a bounded message. `UserCode` is one user reference in a sandbox.
"""

from __future__ import annotations

import functools
import itertools
import json
import logging
import os
import shutil
import signal
import subprocess
import tempfile
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path
from typing import Any

from workers.references import is_path_reference
from workers.sandbox.child import MAX_LINE, plain
from workers.sandbox.launch import CODE, command, open_staging, sandbox_mode
from workers.sandbox.limits import Limits

log = logging.getLogger("tandem.sandbox")
_LAUNCHER = ThreadPoolExecutor(1, thread_name_prefix="tandem-sandbox-launcher")  # never shut down
MESSAGE_CHARS = 2000
CHECK_TIMEOUT_S = 120.0
MAX_ASKS = 32  # questions from one sandbox waiting for or getting an answer
OUTPUT_BYTES = 1 << 20  # what one sandbox's prints may add to the log; the rest is read and dropped
# what the loaders raise: their messages name the reference and say what is wrong
LOADER_ERRORS = {"RewardFunctionError", "EnvironmentReferenceError", "AgentError"}
Asker = Callable[[str, Any], Any]  # (topic, payload) -> answer, for what the sandbox asks


class SandboxError(Exception):
    """An exception raised in the sandbox: its type name, message and traceback lines, bounded."""

    def __init__(self, message: str, type_name: str = "", trace: str = "") -> None:
        self.type, self.message, self.trace = type_name, message, trace
        text = f"{type_name}: {message}" if type_name else message
        super().__init__((text + (f"\n{trace.rstrip()}" if trace else ""))[:MESSAGE_CHARS])


class SandboxCrashed(SandboxError):
    """The sandbox's process ended (or broke the protocol) before it answered."""


class SandboxTimeout(SandboxError):
    """A call did not answer within its time limit."""


class Sandbox:
    def __init__(self, files: Sequence[str | Path] = (), limits: Limits | None = None,
                 asker: Asker | None = None, stderr: int | None = subprocess.DEVNULL,
                 allow_unsandboxed: bool | None = None, mode: str | None = None,
                 pass_fds: Sequence[int] = ()) -> None:  # fmt: skip
        """`stderr` None: what the code prints goes to this process's stderr, the first OUTPUT_BYTES of it;
        `pass_fds`: descriptors the process inherits (a listening socket for a server in it)."""
        self.limits = limits or Limits.from_env()
        self.mode = mode or sandbox_mode(allow_unsandboxed).name  # "none": our own code, or a test
        self.staging = Path(tempfile.mkdtemp(prefix="tandem-sandbox-"))
        self.code = CODE if self.mode != "none" else str(self.staging)
        self.places = {str(Path(f).expanduser().resolve()): self._stage(i, f) for i, f in enumerate(files)}
        open_staging(self.staging)
        argv, env = command(self.mode, self.staging, self.limits)
        self.asker = asker
        self._ids = itertools.count(1)
        self._pending: dict[int, Future] = {}
        self._lock = threading.Lock()
        self._write_lock = threading.Lock()
        self._reap_lock = threading.Lock()
        self._askers = ThreadPoolExecutor(4, thread_name_prefix="tandem-sandbox-ask") if asker else None
        self._ask_slots = threading.BoundedSemaphore(MAX_ASKS)  # each queued ask holds its line in memory
        self.ended: str | None = None
        popen = functools.partial(subprocess.Popen, argv, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE if stderr is None else stderr, cwd=self.staging if self.mode == "none" else None,
                                  start_new_session=True, pass_fds=tuple(pass_fds))  # fmt: skip
        # bwrap's --die-with-parent follows the thread that started it: a pool thread that ends would
        # take a job's sandbox with it, so every sandbox is started by one thread that lives on.
        self.proc = _LAUNCHER.submit(popen).result()
        self._reader = threading.Thread(target=self._read, name="tandem-sandbox-read", daemon=True)
        self._reader.start()
        if stderr is None:
            threading.Thread(target=self._forward, name="tandem-sandbox-output", daemon=True).start()

    def _stage(self, index: int, file: str | Path) -> str:
        source = Path(file).expanduser().resolve()
        folder = self.staging / str(index)
        folder.mkdir()
        shutil.copyfile(source, folder / source.name)
        return f"{self.code}/{index}/{source.name}"

    def place(self, ref: str) -> str:
        """`ref` as the sandbox names it: a file reference points at the staged copy."""
        if not is_path_reference(ref):
            return ref
        source, _, name = ref.rpartition(":")
        staged = self.places.get(str(Path(source).expanduser().resolve()))
        return f"{staged}:{name}" if staged else ref

    def unplace(self, text: str) -> str:
        """A message from the sandbox with the staged copies' paths put back as the caller named them."""
        for source, staged in self.places.items():
            text = text.replace(staged, source)
        return text

    @property
    def alive(self) -> bool:
        return self.ended is None and self.proc.poll() is None

    def call(self, target: str, args: list[Any], timeout_s: float, kill_on_timeout: bool = True) -> Any:
        """`target(*args)` in the sandbox ("module:function" of the service's code); its value."""
        future: Future = Future()
        with self._lock:
            if self.ended is not None:
                raise SandboxCrashed(self.ended)
            call_id = next(self._ids)
            self._pending[call_id] = future
        self._send({"id": call_id, "call": target, "args": args})
        try:
            return future.result(timeout=timeout_s)
        except FutureTimeout:
            self._pending.pop(call_id, None)
            if kill_on_timeout:
                self.close(f"a call did not finish within {timeout_s:g} s")
            raise SandboxTimeout(f"did not finish within {timeout_s:g} s") from None

    def _send(self, message: dict[str, Any]) -> None:
        line = json.dumps(message, default=plain).encode() + b"\n"
        try:
            with self._write_lock:
                assert self.proc.stdin is not None
                self.proc.stdin.write(line)
                self.proc.stdin.flush()
        except (BrokenPipeError, OSError, ValueError):
            self._end(self._exit_reason())

    def _read(self) -> None:
        assert self.proc.stdout is not None
        try:
            while line := self.proc.stdout.readline(MAX_LINE + 1):
                if len(line) > MAX_LINE or not self._take(json.loads(line)):
                    self._end("the sandbox broke its protocol (a reply too long or not understood)")
                    return
        except (ValueError, TypeError, OSError, RecursionError):  # not JSON, too deep, a bad id: the child's
            self._end("the sandbox broke its protocol (a line that is not a message)")
            return
        self._end(self._exit_reason())

    def _forward(self) -> None:
        """The code's prints to this process's stderr, up to OUTPUT_BYTES; past them, read and dropped, so
        that a loop printing forever neither fills the log nor blocks on a full pipe."""
        assert self.proc.stderr is not None
        left = OUTPUT_BYTES
        with open(2, "wb", closefd=False) as out:
            while chunk := self.proc.stderr.read1(1 << 16):
                if left > 0:
                    out.write(
                        chunk[:left]
                        + (b"\n[sandbox output past 1 MiB dropped]\n" if len(chunk) > left else b"")
                    )
                    out.flush()
                left -= len(chunk)

    def _take(self, message: Any) -> bool:
        if not isinstance(message, dict):
            return False
        if "ask" in message:
            if self._askers is None:
                self._reply(message.get("id"), None, "this sandbox answers no questions")
            elif not self._ask_slots.acquire(blocking=False):
                self._reply(message.get("id"), None, f"more than {MAX_ASKS} questions at once: ask fewer")
            else:
                self._askers.submit(self._answer, message)
            return True
        future = self._pending.pop(message.get("id"), None)  # an unknown id: a call that timed out
        if future is not None:
            error = message.get("error")
            if isinstance(error, dict):
                # bounded here: the child may write any size
                fields = (str(error.get(k, ""))[:MESSAGE_CHARS] for k in ("message", "type", "trace"))
                future.set_exception(SandboxError(*map(self.unplace, fields)))
            else:
                future.set_result(message.get("ok"))
        return True

    def _answer(self, message: dict[str, Any]) -> None:
        try:
            self._reply(message.get("id"), self.asker(str(message["ask"]), message.get("args")), None)  # type: ignore[misc]
        except Exception as err:  # the asker's failure is the sandbox's to see, the parent goes on
            self._reply(message.get("id"), None, f"{type(err).__name__}: {err}")
        finally:
            self._ask_slots.release()

    def _reply(self, ask_id: Any, value: Any, error: str | None) -> None:
        self._send({"id": ask_id, "error": {"message": error}} if error else {"id": ask_id, "ok": value})

    def _exit_reason(self) -> str:
        try:
            with self._reap_lock:
                code = self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            return "the sandbox stopped answering"
        return describe_exit(code, self.limits)

    def _end(self, reason: str) -> None:
        with self._lock:
            if self.ended is None:
                self.ended = reason
            pending, self._pending = self._pending, {}
        for future in pending.values():
            future.set_exception(SandboxCrashed(reason))
        self._kill()

    def close(self, reason: str = "the sandbox was closed") -> None:
        """End the process (and all it started) and remove the staged files."""
        self._end(reason)
        if self._askers is not None:
            self._askers.shutdown(wait=False, cancel_futures=True)
        shutil.rmtree(self.staging, ignore_errors=True)

    def _kill(self) -> None:
        # Only while not reaped: a reaped pid may be another process's by now (this lock keeps the
        # reader thread from reaping it between the check and the kill).
        with self._reap_lock:
            if self.proc.poll() is None:
                try:  # its own process group: bwrap, and through it (--die-with-parent) all in the sandbox
                    os.killpg(self.proc.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            log.warning("sandbox process %d did not end after SIGKILL", self.proc.pid)

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class UserCode(Sandbox):
    """A user's reference (reward function, environment, agent) in a sandbox of its own, loaded there at
    once by `check` ("module:function" called with the reference as the sandbox names it, then `args`):
    one that cannot load raises `error` naming it (`what`: "agent 'x.py:f'") and leaves no process."""

    def __init__(self, ref: str, what: str, error: type[Exception], check: str, args: Sequence[Any] = (),
                 timeout_s: float = CHECK_TIMEOUT_S, limits: Limits | None = None, stderr: int | None = None,
                 **options: Any) -> None:  # fmt: skip
        """`stderr` None: what the code prints goes to the job's log; `options`: the Sandbox's."""
        self.ref, limits = ref, limits or Limits.from_env().long_lived()
        super().__init__(staged_files(ref), limits, stderr=stderr, **options)
        self.placed = self.place(ref)
        try:
            self.checked = self.call(check, [self.placed, *args], timeout_s)
        except SandboxError as err:
            self.close()
            raise error(failure(err, what)) from None


def staged_files(ref: str) -> list[str]:
    """The file a 'path/to/file.py:name' reference names, if it is one (else its loader says why)."""
    path = ref.rpartition(":")[0]
    try:
        return [path] if is_path_reference(ref) and Path(path).expanduser().resolve().is_file() else []
    except (OSError, ValueError):
        return []


def failure(err: SandboxError, what: str) -> str:
    """A failed call of `what`'s code in words that name it."""
    if isinstance(err, SandboxTimeout):
        return f"{what} {err.message}"
    if isinstance(err, SandboxCrashed):
        return f"{what} did not finish: {err.message}"
    if err.type in LOADER_ERRORS:
        return err.message
    return f"{what} could not be used: running it raised {err}"


def describe_exit(code: int, limits: Limits) -> str:
    """How the sandbox's process ended, in words (bwrap passes a signal on as 128 + its number)."""
    signum = -code if code < 0 else code - 128 if code > 128 else None
    if signum == signal.SIGXCPU:
        return f"the sandbox reached its CPU time limit ({limits.cpu_s:g} s) and was stopped"
    if signum == signal.SIGKILL:
        return "the sandbox was killed (its memory or CPU limit, or the system's)"
    if signum is not None:
        name = signal.Signals(signum).name if signum in signal.valid_signals() else str(signum)
        return f"the sandbox's process ended on signal {name}"
    return f"the sandbox's process ended (exit code {code}) before it answered"
