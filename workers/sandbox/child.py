"""The sandbox's side: `python -m workers.sandbox CONFIG`, started by channel.py under bwrap.

It drops to its unprivileged uid, sets its limits and moves the protocol off fds 0 and 1 (so user
code that prints cannot garble it), then serves JSON lines, each call in a thread of its own:

    {"id": 7, "call": "module:function", "args": [...]}   ->  {"id": 7, "ok": value}
                                                               {"id": 7, "error": {"type", "message", "trace"}}

`ask(topic, payload)` asks the parent back. Errors carry the user code's traceback lines, bounded.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import threading
import traceback
from concurrent.futures import Future
from typing import Any, BinaryIO

MESSAGE_CHARS = 1500
TRACE_FRAMES = 6
MAX_LINE = 16 * 1024 * 1024  # one message; the parent refuses longer ones
_HERE = os.path.dirname(os.path.abspath(__file__))


def main(argv: list[str]) -> None:
    probe = argv[:1] == ["--probe"]
    config = json.loads(argv[-1])
    _drop_privileges(config.get("uid"))
    _limit(config)
    if probe:
        print("sandbox-ok", flush=True)
        os._exit(0)
    reader, writer = os.fdopen(os.dup(0), "rb"), os.fdopen(os.dup(1), "wb")  # close-on-exec copies
    devnull = os.open(os.devnull, os.O_RDWR)
    os.dup2(devnull, 0)
    os.dup2(2, 1)
    sys.argv = ["sandbox"]  # user code that parses arguments must not see ours
    Channel(reader, writer).serve()
    os._exit(0)  # skip atexit handlers and non-daemon threads the user code may have left


def _drop_privileges(uid: int | None) -> None:
    if uid is None:
        return
    os.setgroups([])
    os.setgid(uid)
    os.setuid(uid)  # from root to another uid: every capability goes too
    if os.getuid() != uid or os.geteuid() != uid:
        raise SystemExit("the sandbox could not drop its privileges")


def _limit(config: dict[str, Any]) -> None:
    import resource

    mb = 1024 * 1024
    limits = {
        resource.RLIMIT_CORE: 0,
        resource.RLIMIT_FSIZE: config.get("file_mb") and config["file_mb"] * mb,
        resource.RLIMIT_AS: config.get("memory_mb") and config["memory_mb"] * mb,
        resource.RLIMIT_NPROC: config.get("processes"),
    }
    for which, value in limits.items():
        if value is not None:
            resource.setrlimit(which, (int(value), int(value)))
    if config.get("cpu_s"):  # SIGXCPU at the soft limit, SIGKILL a little later if that is caught
        seconds = max(1, int(config["cpu_s"]))
        resource.setrlimit(resource.RLIMIT_CPU, (seconds, seconds + 2))


class Channel:
    def __init__(self, reader: BinaryIO, writer: BinaryIO) -> None:
        self.reader, self.writer = reader, writer
        self.lock = threading.Lock()
        self.asks: dict[str, Future] = {}
        self.count = 0

    def serve(self) -> None:
        global _CHANNEL
        _CHANNEL = self
        while line := self.reader.readline(MAX_LINE):
            message = json.loads(line)
            if "call" in message:
                self._start(message)
            elif message.get("id") in self.asks:
                future = self.asks.pop(message["id"])
                if "error" in message:
                    future.set_exception(RuntimeError(message["error"].get("message", "refused")))
                else:
                    future.set_result(message.get("ok"))

    def _start(self, message: dict[str, Any]) -> None:
        try:
            threading.Thread(target=self._run, args=(message,), daemon=True).start()
        except RuntimeError as exc:  # no thread left under the process limit (a fork bomb's remains)
            self.send({"id": message["id"], "error": describe(exc)})

    def _run(self, message: dict[str, Any]) -> None:
        try:
            reply = {"id": message["id"], "ok": _target(message["call"])(*message.get("args", []))}
            self.send(reply)
        except BaseException as exc:  # SystemExit and KeyboardInterrupt too: report them, do not die
            self.send({"id": message["id"], "error": describe(exc)})

    def send(self, message: dict[str, Any]) -> None:
        try:
            line = json.dumps(message, default=plain).encode() + b"\n"
        except (TypeError, ValueError) as err:
            problem = {
                "type": "TypeError",
                "message": f"the value returned is not plain data: {err}",
                "trace": "",
            }
            line = json.dumps({"id": message["id"], "error": problem}).encode() + b"\n"
        with self.lock:
            self.writer.write(line)
            self.writer.flush()


_CHANNEL: Channel | None = None


def ask(topic: str, payload: Any, timeout_s: float) -> Any:
    """Ask the parent (the sandbox's owner) something; its answer, plain data."""
    channel, future = _CHANNEL, Future()
    if channel is None:
        raise RuntimeError("not running in a sandbox")
    with channel.lock:
        channel.count += 1
        ask_id = f"c{channel.count}"
        channel.asks[ask_id] = future
    channel.send({"id": ask_id, "ask": topic, "args": payload})
    return future.result(timeout=timeout_s)


def _target(name: str) -> Any:
    module, _, function = name.partition(":")
    return getattr(importlib.import_module(module), function)


def plain(value: Any) -> Any:
    """JSON for what user code returns beyond JSON's types: numpy / torch scalars and arrays, tuples."""
    if hasattr(value, "tolist"):
        return value.tolist()
    if hasattr(value, "item"):
        return value.item()
    if isinstance(value, set | frozenset):
        return sorted(value, key=repr)
    raise TypeError(f"{type(value).__name__} is not JSON")


def describe(exc: BaseException) -> dict[str, str]:
    """An exception as plain data: its type, its message, and the last lines of its traceback that are
    not this package's (the user's module and the loader that imported it)."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if not _ours(f.filename)]
    trace = "".join(traceback.format_list(frames[-TRACE_FRAMES:]))
    return {"type": type(exc).__name__, "message": str(exc)[:MESSAGE_CHARS], "trace": trace[-MESSAGE_CHARS:]}


def _ours(filename: str) -> bool:
    return filename.startswith(_HERE) or filename.startswith("<frozen ")
